/*
 * Entry points of the `epx` subcommands. Each takes the arguments after the
 * subcommand name (argv[0] is the subcommand itself) and returns the process exit
 * status: 0 success, 1 failure, 2 bad usage; `epx launch` also passes on a rank's
 * status and 124 for its timeout.
 */
#ifndef EPX_TOOLS_COMMANDS_H
#define EPX_TOOLS_COMMANDS_H

int epx__command_launch(int argc, char **argv);
int epx__command_bench(int argc, char **argv);
int epx__command_params(int argc, char **argv);
int epx__command_version(int argc, char **argv);

#endif /* EPX_TOOLS_COMMANDS_H */
