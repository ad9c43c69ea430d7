// Hostile input, by class (docs/cli.md, "Inputs and outputs"): every case ends with exit 2 and one line naming
// the file or flag, writes no output, changes nothing at any path, and neither crashes nor grows
// without bound. The classes:
//   1. an output never replaces what is not a regular file (device, FIFO, socket, directory);
//   2. an output never names an input of the same run, however spelled, nor another output;
//   3. no input crashes the process, and no message echoes a huge value whole;
//   4. no input exhausts the machine: non-regular inputs are handled, every file has a size limit;
//   5. ranks started with different settings end at once naming the setting (under mpirun);
//   6. numbers are what they say (sizes refused at once, not after a long run).
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.h"

namespace {

using cli::BadInput;
using cli::CmdResult;

using cli::expect_refused;
using cli::run_shell;
using cli::scratch;
using cli::write;
namespace fs = std::filesystem;

const std::string kBatch = "{\"ranks\": [[4096, 100], [2048]]}\n";

// What a path is now: its type, inode and (for a regular file) contents, to show nothing changed.
struct Snapshot {
  bool exists = false;
  mode_t type = 0;
  ino_t ino = 0;
  std::string text;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const std::string& path) {
  Snapshot s;
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return s;
  s.exists = true;
  s.type = st.st_mode & S_IFMT;
  s.ino = st.st_ino;
  if (S_ISREG(st.st_mode)) s.text = distca::read_text_file(path).value();
  return s;
}

// Files in `dir` (not recursive): a refused run must leave no temporary file behind.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A scratch sub-folder of its own per test, so listings compare only what this test made.
fs::path folder(const std::string& name) {
  const fs::path d = scratch() / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string make_fifo(const fs::path& dir, const std::string& name) {
  const std::string p = (dir / name).string();
  EXPECT_EQ(::mkfifo(p.c_str(), 0600), 0) << p;
  return p;
}

std::string make_socket(const fs::path& dir, const std::string& name) {
  const std::string p = (dir / name).string();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", p.c_str());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << p;
  ::close(fd);  // the socket file stays
  return p;
}

// A character device of our own (root: mknod of /dev/null's numbers), so that a broken build
// could only ever replace this one; otherwise /dev/full, which a working build never touches.
std::string make_device(const fs::path& dir) {
  const std::string p = (dir / "null-device").string();
  if (::mknod(p.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) return p;
  return "/dev/full";
}

// The commands that write files, each with its output flag as {OUT}; their inputs are valid, so
// only the output path can be what is refused. Each refuses before any work.
struct Writer {
  const char* flag;
  std::string args;  // with {OUT}
};

std::vector<Writer> writers(const std::string& batch) {
  return {
      {"--out", "plan --batch " + batch + " --policy minbytes --out {OUT}"},
      {"--out", "profile --out {OUT}"},
      {"--plot", "simulate --gpus 8 --iterations 1 --plot {OUT}"},
      {"--json", "train --preset tiny --steps 1 --json {OUT}"},
      {"--checkpoint", "train --preset tiny --steps 1 --checkpoint {OUT}"},
  };
}

std::string with_out(std::string args, const std::string& out) {
  args.replace(args.find("{OUT}"), 5, out);
  return args;
}

}  // namespace

// Class 1: an output never replaces a device, a FIFO, a socket or a directory (nor one behind a
// symbolic link); a symbolic link to a regular file is followed (the file is replaced, the link
// stays).
TEST(Hostile, OutputsNeverReplaceWhatIsNotARegularFile) {
  const fs::path dir = folder("class1");
  const std::string batch = write("class1_batch.json", kBatch);
  const std::string fifo = make_fifo(dir, "fifo");
  const std::string sock = make_socket(dir, "socket");
  const std::string device = make_device(dir);
  const std::string sub = (dir / "folder").string();
  fs::create_directories(sub);
  const std::string link_to_fifo = (dir / "link-to-fifo").string();
  fs::create_symlink(fifo, link_to_fifo);
  const std::vector<std::pair<std::string, std::string>> targets = {
      {fifo, "a FIFO"}, {sock, "a socket"}, {device, "a character device"}, {sub, "is a directory"},
      {link_to_fifo, "a FIFO"}};
  for (const Writer& w : writers(batch)) {
    for (const auto& [target, kind] : targets) {
      const Snapshot before = snapshot(target), fifo_before = snapshot(fifo);
      const auto files_before = listing(dir);
      const auto start = std::chrono::steady_clock::now();
      CmdResult r = cli::distca(with_out(w.args, target));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::string name = std::string(w.flag) + " " + target + " (" + w.args + ")";
      expect_refused(r, {name.c_str(), "", w.flag});
      EXPECT_NE(r.err.find(kind), std::string::npos) << name << ": " << r.err;
      EXPECT_LT(seconds, 10.0) << name << ": refused only after work";
      EXPECT_EQ(snapshot(target), before) << name;
      EXPECT_EQ(snapshot(fifo), fifo_before) << name;
      EXPECT_EQ(listing(dir), files_before) << name << ": a file was left behind";
    }
  }
  // A link to a regular file: the file it names gets the plan, the link stays a link.
  const std::string file = write("class1/plan.json", "old\n");
  const std::string link = (dir / "link-to-plan").string();
  fs::create_symlink(file, link);
  CmdResult ok = cli::distca("plan --batch " + batch + " --policy minbytes --out " + link);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_NE(distca::read_text_file(file).value().find("distca-plan"), std::string::npos);
}

// Class 2: an output never names an input of the same run (the same path, another spelling, a
// symbolic link, a hard link, a file inside an input folder) nor another output; the input is
// left byte for byte as it was.
TEST(Hostile, OutputsNeverReplaceTheRunsInputs) {
  const fs::path dir = folder("class2");
  const std::string batch = write("class2/batch.json", kBatch);
  const std::string symlink = (dir / "batch-link.json").string();
  fs::create_symlink(batch, symlink);
  const std::string hardlink = (dir / "batch-hard.json").string();
  fs::create_hard_link(batch, hardlink);
  const std::string lengths = write("class2/lengths.json", "[100, 2000, 4096, 300]\n");
  const std::string profile = cli::simple_profile(1e11);
  const std::string data = write("class2/data.jsonl", "{\"text\": \"one document of training text\"}\n");
  const fs::path docs = dir / "docs";
  fs::create_directories(docs);
  write("class2/docs/a.txt", "a document in a folder of text files\n");
  const std::string spelled = (dir / "." / ".." / "class2" / "batch.json").string();
  const BadInput cases[] = {
      {"same path", "plan --batch " + batch + " --out " + batch, "names the same file as --batch"},
      {"other spelling", "plan --batch " + batch + " --out " + spelled, "names the same file as --batch"},
      {"symbolic link", "plan --batch " + symlink + " --out " + batch, "names the same file as --batch"},
      {"hard link", "plan --batch " + hardlink + " --out " + batch, "names the same file as --batch"},
      {"doc lengths", "plan --doc-lengths " + lengths + " --ranks 2 --tokens-per-rank 4096 --out " + lengths,
       "names the same file as --doc-lengths"},
      {"plan profile", "plan --batch " + batch + " --profile " + profile + " --out " + profile,
       "names the same file as --profile"},
      {"simulate profile", "simulate --gpus 8 --profile " + profile + " --plot " + profile,
       "names the same file as --profile"},
      {"train data", "train --preset tiny --steps 1 --data " + data + " --json " + data, "names the same file as --data"},
      {"train data as checkpoint", "train --preset tiny --steps 1 --data " + data + " --checkpoint " + data,
       "names the same file as --data"},
      {"inside the data folder", "train --preset tiny --steps 1 --data " + docs.string() + " --json " +
                                     (docs / "report.json").string(),
       "inside the folder"},
      {"two outputs", "train --preset tiny --steps 1 --json " + (dir / "x.json").string() + " --checkpoint " +
                          (dir / "." / "x.json").string(),
       "name the same file"},
  };
  for (const BadInput& c : cases) {
    const std::vector<std::string> watched = {batch, lengths, profile, data, (docs / "a.txt").string()};
    std::vector<Snapshot> before;
    for (const auto& p : watched) before.push_back(snapshot(p));
    const auto files_before = listing(dir);
    CmdResult r = cli::distca(c.args);
    expect_refused(r, c);
    for (size_t i = 0; i < watched.size(); ++i) EXPECT_EQ(snapshot(watched[i]), before[i]) << c.name << ": " << watched[i];
    EXPECT_EQ(listing(dir), files_before) << c.name;
    EXPECT_FALSE(fs::exists(docs / "report.json")) << c.name;
  }
  // --resume and --checkpoint on one file is how a run continues; --json over it is refused.
  const std::string ck = (dir / "ck.bin").string();
  CmdResult saved = cli::distca("train --preset tiny --steps 1 --checkpoint " + ck);
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const Snapshot ck_before = snapshot(ck);
  expect_refused(cli::distca("train --preset tiny --steps 2 --resume " + ck + " --json " + ck),
                 {"json over resume", "", "names the same file as --resume"});
  EXPECT_EQ(snapshot(ck), ck_before);
}

// Class 3: inputs that once crashed (an uncaught exception, a stack overflow) or could: each
// file parser gets numbers out of range, deep nesting, huge values, bytes that are not UTF-8,
// and wrong types; every case is one short line and exit 2. A message quotes at most a short
// excerpt of what it read.
TEST(Hostile, NoInputCrashesAndNoMessageEchoesAHugeValue) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string huge_number = std::string(200000, '9');
  const std::string huge_string = "\"" + std::string(300000, 'x') + "\"";
  struct Case {
    const char* name;
    std::string text;
    const char* expected;
  };
  const std::vector<Case> texts = {
      {"1e400", "{\"ranks\": [[1e400]]}", "number overflow"},
      {"-1e400", "{\"ranks\": [[-1e400]]}", "number overflow"},
      {"deep nesting", deep, "nested more than 64 levels"},
      {"deep objects", std::string(50000, '{'), "nested more than 64 levels"},
      {"huge integer", "{\"ranks\": [[" + huge_number + "]]}", ""},
      {"huge string", "{\"ranks\": [[" + huge_string + "]]}", "expected a positive integer"},
      {"huge key", "{" + huge_string + ": 1}", "expected an object"},
      {"huge key beside ranks", "{\"ranks\": [[1]], " + huge_string + ": 1}", "unknown key"},
      {"not UTF-8", "{\"ranks\": [[\"\xff\xfe\"]]}", ""},
      {"NUL bytes", std::string("{\"ranks\": [[1\0 2]]}", 18), ""},
      {"float length", "{\"ranks\": [[128.9]]}", "expected a positive integer"},
      {"bool length", "{\"ranks\": [[true]]}", "expected a positive integer"},
      {"empty", "", "is empty"},
      {"whitespace", " \n\t\n", "is empty"},
  };
  // Each text in each JSON input a command reads.
  const std::vector<std::pair<std::string, std::string>> readers = {
      {"--batch", "plan --batch {IN}"},
      {"--doc-lengths", "plan --doc-lengths {IN} --ranks 2 --tokens-per-rank 4096"},
      {"--profile", "simulate --gpus 8 --iterations 1 --profile {IN}"},
      {"--resume", "train --preset tiny --steps 1 --resume {IN}"},
  };
  int n = 0;
  for (const auto& [flag, args] : readers) {
    for (const Case& c : texts) {
      const std::string in = write("class3_" + std::to_string(n++) + ".json", c.text);
      std::string cmd = args;
      cmd.replace(cmd.find("{IN}"), 4, in);
      CmdResult r = cli::distca(cmd);
      const std::string name = flag + " " + c.name;
      EXPECT_EQ(r.exit_code, 2) << name << ": " << r.err.substr(0, 500);
      EXPECT_EQ(cli::count_lines(r.err), 1) << name << ": " << r.err.substr(0, 500);
      EXPECT_LT(r.err.size(), 600u) << name << ": the message echoes the input: " << r.err.substr(0, 500);
      EXPECT_NE(r.err.find(in), std::string::npos) << name << ": the file is not named: " << r.err;
      if (flag == "--batch" && *c.expected) EXPECT_NE(r.err.find(c.expected), std::string::npos) << name << ": " << r.err;
    }
  }
  // Data files: a bad line names its line; a huge line is not echoed.
  const std::string data = write("class3_data.jsonl", "{\"text\": \"fine\"}\n" + deep + "\n{\"text\": " + huge_number + "}\n");
  CmdResult r = cli::distca("train --preset tiny --steps 1 --data " + data);
  expect_refused(r, {"data lines", "", "class3_data.jsonl:2: malformed JSON: nested"});
  EXPECT_LT(r.err.size(), 600u);
}

// Class 4: inputs that could exhaust the machine. Devices and sockets are refused, a FIFO is read
// to its end (one with no writer reads as empty, never waits), every file is limited to
// DISTCA_MAX_INPUT_MB (default 1024 MiB) whether its size is known or it streams, and the limit
// itself is checked. Memory stays bounded: the stream cases run under an address-space cap (2 GiB
// at a 64 MiB limit, 3 GiB at the default 1024 MiB).
TEST(Hostile, NoInputExhaustsTheMachine) {
  const fs::path dir = folder("class4");
  const std::string fifo = make_fifo(dir, "no-writer");
  const std::string fifo_jsonl = make_fifo(dir, "fifo.jsonl");
  const std::string big = (dir / "big.json").string();
  {
    std::ofstream out(big);
    out << "{\"ranks\": [[" << std::string(3 << 20, ' ') << "1]]}";
  }
  const std::string data = write("class4/data.jsonl", "{\"text\": \"" + std::string(3 << 20, 'a') + "\"}\n");
  const std::string bin = DISTCA_BIN;
  const BadInput cases[] = {
      {"/dev/zero as batch", bin + " plan --batch /dev/zero", "is a character device"},
      {"/dev/urandom as doc lengths", bin + " plan --doc-lengths /dev/urandom --ranks 2", "is a character device"},
      {"/dev/zero as profile", bin + " simulate --gpus 8 --profile /dev/zero", "is a character device"},
      {"/dev/zero as data", bin + " train --preset tiny --steps 1 --data /dev/zero", "--data"},
      {"/dev/zero as checkpoint", bin + " train --preset tiny --steps 1 --resume /dev/zero", "is a character device"},
      {"a directory as batch", bin + " plan --batch " + dir.string(), "is a directory"},
      {"a FIFO with no writer", "timeout 20 " + bin + " plan --batch " + fifo, "is empty"},
      {"a FIFO as data (read every epoch)", "timeout 20 " + bin + " train --preset tiny --steps 1 --data " + fifo_jsonl,
       "must be a regular file"},
      {"over the limit", "DISTCA_MAX_INPUT_MB=1 " + bin + " plan --batch " + big, "too large"},
      {"data over the limit", "DISTCA_MAX_INPUT_MB=1 " + bin + " train --preset tiny --steps 1 --data " + data,
       "too large"},
      {"an endless stream", "(ulimit -v 2097152; DISTCA_MAX_INPUT_MB=64 timeout 60 " + bin +
                                " plan --batch <(yes '[[[[[[[['))",
       "too large"},
      {"an endless stream at the default limit",
       "(ulimit -v 3145728; timeout 120 " + bin + " plan --batch <(yes 1))", "more than 1024 MiB"},
      {"a bad limit", "DISTCA_MAX_INPUT_MB=lots " + bin + " plan --batch " + big, "DISTCA_MAX_INPUT_MB=lots"},
      {"a zero limit", "DISTCA_MAX_INPUT_MB=0 " + bin + " plan --batch " + big, "DISTCA_MAX_INPUT_MB=0"},
  };
  for (const BadInput& c : cases) {
    // bash for <(...) and ulimit.
    std::string quoted = c.args;
    for (size_t i = 0; (i = quoted.find('\'', i)) != std::string::npos; i += 4) quoted.replace(i, 1, "'\\''");
    CmdResult r = run_shell("bash -c '" + quoted + "'");
    expect_refused(r, c);
  }
  EXPECT_TRUE(S_ISFIFO(snapshot(fifo).type));
  // Within the limit a pipe is read to its end.
  CmdResult ok = run_shell("bash -c '" + bin + " plan --json --batch <(echo \"{\\\"ranks\\\": [[4096], [512]]}\")'");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// Class 6: a size the command cannot run is refused at once with exit 2 (it once ran 13 s and
// exited 1), the same ceiling as plan's.
TEST(Hostile, SizesBeyondTheCeilingAreRefusedAtOnce) {
  const BadInput cases[] = {
      {"gpus", "simulate --gpus 1000000000", "--gpus must be in [1, 1000000]"},
      {"tp", "simulate --gpus 64 --tp 2000000000", "--tp must be in [1, 1000000]"},
      {"tp x pp x cp", "simulate --gpus 64 --tp 8 --pp 8 --cp 8", "is more than --gpus"},
      {"replicas x context", "simulate --gpus 1000000", "tokens per step"},
      {"plan ranks", "plan --ranks 1000000000", "--ranks must be in [1, 1000000]"},
  };
  for (const BadInput& c : cases) {
    const auto start = std::chrono::steady_clock::now();
    expect_refused(cli::distca(c.args), c);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0) << c.name;
  }
}

#ifdef DISTCA_MPIRUN
// Class 5: ranks started with different settings. Every rank ends within seconds with exit 2, one
// line names the first setting that differs, and no report is written.
TEST(Hostile, RanksStartedWithDifferentSettingsEndAtOnceNamingTheSetting) {
  const fs::path dir = folder("class5");
  const std::string json = (dir / "report.json").string();
  const std::string bin = DISTCA_BIN;
  const std::string mpirun = std::string(DISTCA_MPIRUN) + " -q --allow-run-as-root --oversubscribe --bind-to none";
  struct Case {
    const char* name;
    std::string rank0, rank1;
    const char* expected;
  };
  const Case cases[] = {
      {"steps", "--steps 5", "--steps 3", "--steps is 5 on rank 0 and 3 on rank 1"},
      {"policy", "--policy minbytes", "--policy minmax", "--policy is minbytes on rank 0 and minmax on rank 1"},
      {"preset", "--preset tiny", "--preset demo", "--preset is tiny on rank 0 and demo on rank 1"},
      {"a flag on one rank", "", "--seed 7", "--seed is"},
  };
  for (const Case& c : cases) {
    const std::string common = " train --attention cad --json " + json + " ";
    const std::string base = c.name == std::string("preset") ? "" : "--preset tiny ";
    const auto start = std::chrono::steady_clock::now();
    CmdResult r = run_shell(mpirun + " -np 1 " + bin + common + base + c.rank0 + " : -np 1 " + bin + common + base +
                            c.rank1);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    expect_refused(r, {c.name, "", c.expected});
    EXPECT_NE(r.err.find("different settings"), std::string::npos) << c.name << ": " << r.err;
    EXPECT_LT(seconds, 30.0) << c.name << ": the job did not end at once";
    EXPECT_FALSE(fs::exists(json)) << c.name << ": a report was written";
  }
  // A setting that is bad on one rank only: that rank fails before MPI starts, so it says so itself
  // (rank 0 has no error to print); the same bad setting on every rank is reported once.
  for (const auto& [args, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--steps 0", "rank 1: error: --steps must be >= 1, got 0"},
           {"--stepz 2", "rank 1: error: The following arguments were not expected"}}) {
    CmdResult r = run_shell(mpirun + " -np 1 " + bin + " train --preset tiny --steps 2 : -np 1 " + bin +
                            " train --preset tiny " + args);
    expect_refused(r, {args.c_str(), "", expected.c_str()});
  }
  CmdResult both = run_shell(mpirun + " -np 2 " + bin + " train --preset tiny --steps 0");
  expect_refused(both, {"bad on every rank", "", "distca train: error: --steps must be >= 1"});
  // The same settings still run (the check costs one small exchange).
  CmdResult ok = run_shell(mpirun + " -np 2 " + bin + " train --preset tiny --steps 1 --json " + json);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(json));
}
#endif
