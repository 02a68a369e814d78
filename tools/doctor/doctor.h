/*
 * `epx doctor`: a checklist that answers "will epx work on this machine, and at full
 * speed?" (GPUs, links, CUDA IPC, MPS, NVSHMEM, RDMA, driver options, settings, and a
 * short measured run). docs/DEPLOYMENT.md explains every line.
 */
#ifndef EPX_TOOLS_DOCTOR_H
#define EPX_TOOLS_DOCTOR_H

/*
 * Entry point of the subcommand (argv[0] is "doctor"). Exit status: 0 when no check
 * failed (warnings allowed), 1 when one did, 2 for bad usage.
 */
int epx__command_doctor(int argc, char **argv);

#endif /* EPX_TOOLS_DOCTOR_H */
