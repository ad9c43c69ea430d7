// Where a multi-rank command runs: under an MPI launcher (mpirun, srun) this process is one
// rank of an MpiComm; otherwise `local_ranks` threads over LocalComm in this process.
//
// Exit codes, the same with and without mpirun (docs/cli.md, "Exit codes"):
//   0  done
//   2  bad input: a flag, a file, the data, an output path, a run that cannot fit in memory
//   1  the run failed: an I/O error while running, a timeout, a failed rank
#pragma once
#include <chrono>
#include <functional>
#include <string>

#include "distca/comm/communicator.h"
#include "distca/core/memory.h"  // is_under_mpi

namespace distca::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadInput = 2;

// This process prints usage errors: it is rank 0 of an MPI launch, or there is no launch. Under
// mpirun every process parses the same flags and finds the same error; only one says so.
bool is_primary_process();
// Prints a usage error line ("distca <command>: error: ...") once for the job: on the primary
// process at once; on another rank of an MPI launch only after a few seconds, with its rank, if
// mpirun has not ended it by then (the primary failed the same way and said so) — so a rank
// started with another command line is not silent.
void print_error_line(const std::string& line);
// print_error_line("distca <command>: error: <message>").
void print_usage_error(const std::string& command, const std::string& message);
// The exit code of a Status: 2 for bad input (kInvalidArgument, kNotFound), 1 otherwise.
int exit_code(const Status& s);

struct WorldOptions {
  bool is_ranks_given = false;  // --ranks was on the command line (refused under mpirun)
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};  // every collective's
};

// --timeout's help, default and range (1..86400 s), the same on every multi-rank command.
inline constexpr double kDefaultTimeoutSeconds = 120;
inline constexpr const char* kTimeoutHelp =
    "seconds any collective may wait for a peer before the job ends with an error naming it (1..86400)";
// `seconds` as a collective timeout, or kInvalidArgument naming --timeout.
Result<std::chrono::milliseconds> timeout_from_seconds(double seconds);

// The settings this process was started with (the command's options with their values, one
// "name=value" line each, as CLI11's config_to_str writes them), set once by main after parsing.
// Under mpirun, run_world compares them across ranks before any work: ranks started with
// different settings all end with exit 2 naming the first setting that differs.
void set_run_settings(std::string settings);
// The first setting that differs between two settings texts, as "--steps is 5 on rank 0 and 3 on
// rank 1"; empty when they are the same.
std::string first_difference(const std::string& a, int rank_a, const std::string& b, int rank_b);
// Exchanges the settings over `c` and compares every rank's with rank 0's: kInvalidArgument
// naming the first setting that differs (the same message on every rank).
Status check_same_settings(comm::Communicator& c, const std::string& settings);

// Runs `body` on every rank and returns the exit code. The error reaches the user once:
// - when every rank ends (done or failed) within a few seconds of each other, as with bad data
//   that every rank reads, the lowest failing rank prints its error and every process exits
//   with its code after a clean finalize (no MPI_Abort);
// - when a rank fails while its peers wait in an operation for it, it prints its error and
//   ends the whole job (MPI: MPI_Abort with the code; LocalComm: the peers' operations fail).
int run_world(const std::string& command, int local_ranks, const std::function<Status(comm::Communicator&)>& body,
              const WorldOptions& options = {});

}  // namespace distca::tools
