/*
 * Running `epx doctor` checks in child processes. Everything that touches the GPU
 * driver, NVSHMEM or another rank runs in a child of its own: a driver that crashes or
 * hangs, a library that prints to stdout, or a CUDA context (which must not exist in a
 * process that forks later) can then never harm the doctor or its JSON output.
 */
#ifndef EPX_TOOLS_DOCTOR_CHILD_H
#define EPX_TOOLS_DOCTOR_CHILD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "doctor_report.h"

/* A check body. `facts` (may be NULL) is zeroed before the call and sent back. */
typedef void (*epx__doctor_child_fn_t)(epx__doctor_report_t *report, void *arg, void *facts);

#define EPX__DOCTOR_CHILD_DONE 0
#define EPX__DOCTOR_CHILD_CRASHED (-1)
#define EPX__DOCTOR_CHILD_TIMED_OUT (-2)

/*
 * Run `fn` in a forked child, in a process group of its own, with its stdout and stderr
 * captured. Its lines are appended to `report` and `facts` (facts_size bytes) is
 * copied back. When the child crashes, or is still running after timeout_s, its whole
 * process group is killed and a FAIL line named `name` says what happened and what the
 * child printed last. Returns one of EPX__DOCTOR_CHILD_*.
 */
int epx__doctor_run_child(epx__doctor_report_t *report, const char *name, double timeout_s,
                          epx__doctor_child_fn_t fn, void *arg, void *facts, size_t facts_size);

/* In a child run by epx__doctor_run_child: the last line it (or its children) printed. */
void epx__doctor_child_output_tail(char *out, size_t out_size);

/* Write / read exactly `bytes` (retrying on EINTR and short transfers); 0 on success. */
int epx__doctor_write_all(int fd, const void *data, size_t bytes);
int epx__doctor_read_all(int fd, void *data, size_t bytes, int64_t deadline_ns);

/*
 * Run a program (argv[0] searched in PATH) in a process group of its own, with `input`
 * (may be NULL) on its stdin and its stdout, cut to output_size - 1 bytes, in `output`
 * (may be NULL); stderr goes to `errors` the same way (may be NULL). Returns its exit
 * status (128 + signal for a signal), or -1 when it could not start or had to be
 * killed after timeout_s (then *timed_out, if given, is 1).
 */
int epx__doctor_run_program(char *const argv[], const char *input, char *output,
                            size_t output_size, char *errors, size_t errors_size,
                            double timeout_s, int *timed_out);

/* Full path of an executable `name` found in PATH into `out`; 1 when found. */
int epx__doctor_find_in_path(const char *name, char *out, size_t out_size);

#endif /* EPX_TOOLS_DOCTOR_CHILD_H */
