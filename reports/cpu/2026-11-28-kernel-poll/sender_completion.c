// When does an Open MPI message complete while its peer computes without calling MPI?
//   mpicc -O2 sender_completion.c -o sender_completion
//   mpirun -q --allow-run-as-root -np 2 [--mca ...] ./sender_completion BYTES
// Both ranks post a receive from and a send to each other, as an exchange of ping-pong does. Rank 0
// then computes for 300 ms without an MPI call; rank 1 waits at once, first for its receive, then
// for its send. Rank 1 prints both waits (three repetitions).
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const long bytes = argc > 1 ? atol(argv[1]) : 2097152;
  const int peer = 1 - rank;
  char* send = malloc((size_t)bytes);
  char* recv = malloc((size_t)bytes);
  for (long i = 0; i < bytes; ++i) send[i] = (char)i;
  for (int it = 0; it < 3; ++it) {
    MPI_Request req[2];
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Irecv(recv, (int)bytes, MPI_BYTE, peer, 0, MPI_COMM_WORLD, &req[0]);
    MPI_Isend(send, (int)bytes, MPI_BYTE, peer, 0, MPI_COMM_WORLD, &req[1]);
    const double t0 = now();
    if (rank == 0) {  // computes, no MPI call
      volatile double x = 0;
      while (now() - t0 < 0.3) x += 1;
    }
    MPI_Wait(&req[0], MPI_STATUS_IGNORE);
    const double received = now() - t0;
    MPI_Wait(&req[1], MPI_STATUS_IGNORE);
    const double sent = now() - t0;
    if (rank == 1) printf("%ld bytes: receive done after %.1f ms, send after %.1f ms\n", bytes, received * 1e3, sent * 1e3);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
