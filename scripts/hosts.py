#!/usr/bin/env python3
"""Test "hosts" made of network namespaces on this machine, for multi-host runs with Open MPI (and
torch.distributed): N namespaces PREFIX0..PREFIX(N-1), each with lo and one veth `eth0`
(SUBNET.K+1/24) joined to a bridge PREFIXbr (SUBNET.254/24) in the root namespace, links
optionally shaped (rate, delay, loss) on each host's eth0 egress. See --help.

What up makes is recorded, item by item as it is made, in /run/distca-hosts/PREFIX/state, and
marked: every link it makes and each namespace's lo carry the alias distca-hosts:PREFIX:TOKEN
(TOKEN: random, one per up). down, shape, link-down/up and status touch only what is recorded
there and still carries the mark (for a namespace: its inode too; for a link: its ifindex too):
never a namespace, link or process they did not make, whatever its name.

Standard library only, so that it runs as root before any virtual environment exists. It drives
iproute2 (`ip`, with its JSON output, and `tc`), `unshare` and `nsenter` with argument lists.
scripts/netns-agent.sh, Open MPI's rsh agent for these hosts, stays a shell script: mpirun execs
it once per daemon as it would exec ssh, and all it does is map a host to its namespace and exec.
"""
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

if sys.version_info < (3, 9):
    sys.exit(f"hosts.py: needs Python 3.9 or later (this is {sys.version.split()[0]})")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
AGENT = os.path.join(HERE, "netns-agent.sh")
TAG = "distca-hosts"                 # the alias marker (TAG:PREFIX:TOKEN) on every interface up makes
STATE_ROOT = "/run/distca-hosts"     # PREFIX/state: what up made (tmpfs, like the namespaces: gone at reboot)
STATE_FORMAT = "distca-hosts-state 1"
NETNS_DIR = "/var/run/netns"         # where `ip netns` keeps its names
IFACE = "eth0"                       # the host's interface inside its namespace
MAX_HOSTS = 32
DEFAULT_PREFIX = "distca-h"
DEFAULT_SUBNET = "10.77.0"
DEFAULT_SLOTS = "2"
COMMANDS = ("up", "down", "shape", "link-down", "link-up", "status")

USAGE = f"""\
usage: scripts/hosts.py COMMAND [ARGS] [OPTIONS]

Test hosts made of network namespaces (needs root / CAP_NET_ADMIN + CAP_SYS_ADMIN).

commands:
  up N          make N hosts (1..{MAX_HOSTS}): namespaces PREFIX0..PREFIX(N-1), each with lo and
                {IFACE} (SUBNET.1 .. SUBNET.N /24) on bridge PREFIXbr (SUBNET.254/24, so this
                namespace, where mpirun runs, reaches them). Records each thing it makes in
                {STATE_ROOT}/PREFIX/state and marks it: the alias
                {TAG}:PREFIX:TOKEN on every link and on each namespace's lo. A set
                that up made with the prefix is removed first; a namespace or link with one of
                the names that up did not make is left alone, and up stops (exit 1). Writes
                DIR/hostfile, DIR/hosts.env, DIR/hosts.json. Exit 77 (CTest skip) where
                namespaces cannot be made here.
  down          remove exactly what up recorded and marked for the prefix: its namespaces
                (stopping what still runs in them), veth pairs, bridge (and the bridge's route),
                and DIR's files. Nothing else is touched, even with the prefix's names. A
                recorded thing that is already gone (deleted by hand) or cannot be removed:
                down removes the rest, prints one line for each, and exits 1. Nothing recorded:
                succeeds quietly.
  shape         set the shaping of existing hosts in place (replaces what they had):
                --rate/--delay/--loss [--host K], or --clear [--host K]
  link-down K   set host K's {IFACE} down (a dropped link); link-up K: up again
  status        hosts, addresses, link state and shaping (--json: as JSON)

options:
  --prefix NAME   namespace/interface prefix (default {DEFAULT_PREFIX}; [A-Za-z0-9_-], at most 12 chars,
                  not starting with '-' nor ending with a digit)
  --dir DIR       where up writes its files (default build/hosts under the repository; down:
                  the one up recorded)
  --subnet A.B.C  the hosts' /24: three decimal octets 0..255 without leading zeros, inside
                  10/8, 172.16/12 or 192.168/16 (default {DEFAULT_SUBNET})
  --slots S       slots per host in the hostfile (1..9999, default {DEFAULT_SLOTS})
  --rate R        egress rate of each host, e.g. 1gbit, 200mbit
  --delay D       egress delay, e.g. 1ms, 500us
  --loss P        egress packet loss, e.g. 5%
  --host K        shape: only host K (index, address or namespace name)
  --clear         shape: remove the shaping
  --json          status: JSON
  -h, --help      this help

Every argument is checked before anything is made: a bad one is one line on stderr, exit 2.
Only an option that a command takes may be given to it, even at its default value.

Shaping uses a netem qdisc on each host's {IFACE}. Where the kernel has no netem
(CONFIG_NET_SCH_NETEM), --rate and --loss fall back to htb (+ a classic-BPF filter sending P% of
the packets to a class that drops them); --delay then exits 77.

With Open MPI (mpirun runs here, reaching the hosts through the bridge; scripts/netns-agent.sh,
its rsh agent, starts each host's daemon in the host's namespace, with the namespace's name as
hostname; out-of-band and MPI traffic use only the hosts' subnet, no shared memory):
  source build/hosts/hosts.env
  mpirun --allow-run-as-root --oversubscribe --bind-to none $DISTCA_MPIRUN_HOST_FLAGS \\
    --hostfile "$DISTCA_HOSTS_HOSTFILE" --map-by node -np 2 ./build/src/tools/distca ...
A link that drops (link-down) ends such a job in about 11 s ("ORTE has lost communication with a
remote daemon"), from the keepalive settings in the flags (5 s idle, then 5 probes 1 s apart).

torch.distributed (gloo) on the hosts, one process per host:
  ip netns exec PREFIX0 env MASTER_ADDR=SUBNET.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME={IFACE} \\
    RANK=0 WORLD_SIZE=2 python train.py &      # and RANK=1 in PREFIX1

Needs iproute2 with JSON output (ip -j).
"""


# ---- exits ----------------------------------------------------------------------------------------
def die(code, message):
    print(f"hosts.py: {message}", file=sys.stderr)
    sys.exit(code)


def skip(message):
    die(77, f"skipped: {message}")


class CommandFailed(Exception):
    """A command that had to succeed did not: its words and exit status (its stderr went to ours)."""

    def __init__(self, args, returncode):
        super().__init__(f"`{' '.join(args)}` exited {returncode}")


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that up removes what it made."""


# ---- running commands -----------------------------------------------------------------------------
def run(args, check=True, stdin=None):
    """Runs ARGS (a list, no shell). check: a failure raises CommandFailed, and the command's stderr
    reaches ours; otherwise its stderr is dropped. Returns the CompletedProcess (stdout as text)."""
    try:
        proc = subprocess.run(args, input=stdin, stdout=subprocess.PIPE,
                              stderr=None if check else subprocess.DEVNULL, text=True)
    except FileNotFoundError:  # no such program: as a shell would say it
        proc = subprocess.CompletedProcess(args, 127, "")
        if check:
            print(f"hosts.py: {args[0]}: command not found", file=sys.stderr)
    if check and proc.returncode != 0:
        raise CommandFailed(args, proc.returncode)
    return proc


def in_netns(ns, args):
    """ARGS run inside namespace NS."""
    return ["ip", "netns", "exec", ns] + args


def ip_json(args, ns=None):
    """`ip -j [-n NS] ARGS` parsed; None where it fails (e.g. the device does not exist)."""
    proc = run(["ip", "-j"] + (["-n", ns] if ns else []) + args, check=False)
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout or "[]")
    except json.JSONDecodeError:
        return None


def ip_problem():
    """'' where iproute2's `ip` with JSON output is here, else why not."""
    if shutil.which("ip") is None:
        return "no 'ip' (iproute2)"
    if ip_json(["link", "show", "dev", "lo"]) is None:
        return "'ip -j' (iproute2's JSON output) does not work here: a newer iproute2 is needed"
    return ""


def is_root_capable():
    """CAP_NET_ADMIN (12) and CAP_SYS_ADMIN (21, for the namespace mounts) in effect."""
    try:
        with open("/proc/self/status") as f:
            cap = next((line.split()[1] for line in f if line.startswith("CapEff:")), "")
        bits = int(cap, 16)
    except (OSError, ValueError, IndexError):
        return False
    return bool((bits >> 12) & 1 and (bits >> 21) & 1)


# ---- the command line -----------------------------------------------------------------------------
@dataclasses.dataclass
class Shaping:
    rate: str = ""   # tc rate, lower case, e.g. 200mbit
    delay: str = ""  # tc time, lower case, e.g. 1ms
    loss: str = ""   # a percentage with its %, e.g. 5%

    def __bool__(self):
        return bool(self.rate or self.delay or self.loss)

    def describe(self):
        return f"rate={self.rate or '-'} delay={self.delay or '-'} loss={self.loss or '-'}"


@dataclasses.dataclass
class Config:
    """What the command line asks for, checked; and the names derived from it."""
    command: str
    positional: list
    given: set            # the options given on the command line (without their dashes)
    prefix: str = DEFAULT_PREFIX
    dir: str = ""
    subnet: str = DEFAULT_SUBNET
    slots: str = DEFAULT_SLOTS
    shaping: Shaping = dataclasses.field(default_factory=Shaping)
    host: str = ""
    clear: bool = False
    json: bool = False

    @property
    def bridge(self):
        return f"{self.prefix}br"

    @property
    def bridge_addr(self):
        return f"{self.subnet}.254"

    @property
    def cidr(self):
        return f"{self.subnet}.0/24"


VALUE_OPTIONS = ("prefix", "dir", "subnet", "slots", "rate", "delay", "loss", "host")
FLAG_OPTIONS = ("clear", "json")
TAKES = {  # the options each command takes
    "up": ("prefix", "dir", "subnet", "slots", "rate", "delay", "loss"),
    "down": ("prefix", "dir"),
    "shape": ("prefix", "rate", "delay", "loss", "host", "clear"),
    "link-down": ("prefix",),
    "link-up": ("prefix",),
    "status": ("prefix", "json"),
}


def parse_command_line(argv):
    """The command, its options and its arguments, as given (checked by check_config)."""
    if not argv:
        sys.stderr.write(USAGE)
        sys.exit(2)
    command = argv[0]
    if command in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        sys.exit(0)
    if command not in COMMANDS:
        die(2, f"unknown command '{command}' ({', '.join(COMMANDS)}; --help)")
    values = {}
    positional = []
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        name = arg[2:]
        if arg in ("-h", "--help"):
            sys.stdout.write(USAGE)
            sys.exit(0)
        elif arg.startswith("--") and name in VALUE_OPTIONS:
            if not args or args[0] == "":
                die(2, f"{arg} needs a value")
            values[name] = args.pop(0)
        elif arg.startswith("--") and name in FLAG_OPTIONS:
            values[name] = True
        elif arg.startswith("--") and "=" in arg:
            option, _, value = arg.partition("=")
            args[0:0] = [option, value]
        elif arg.startswith("-"):
            die(2, f"unknown option '{arg}' (--help)")
        else:
            positional.append(arg)
    for name in VALUE_OPTIONS + FLAG_OPTIONS:  # in this order, as the help lists them
        if name in values and name not in TAKES[command]:
            die(2, f"{command} does not take --{name}")
    cfg = Config(command=command, positional=positional, given=set(values))
    for name in ("prefix", "dir", "subnet", "slots", "host", "clear", "json"):
        if name in values:
            setattr(cfg, name, values[name])
    cfg.shaping = Shaping(values.get("rate", ""), values.get("delay", ""), values.get("loss", ""))
    return cfg


OCTET = r"(0|[1-9][0-9]{0,2})"


def subnet_problem(subnet):
    """Why SUBNET is no private /24 of three decimal octets; '' where it is one."""
    if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", subnet):
        return "not three dotted decimal octets"
    m = re.fullmatch(rf"{OCTET}\.{OCTET}\.{OCTET}", subnet)
    if not m:
        return "an octet with a leading zero (which iproute2 reads as octal) or of more than 3 digits"
    a, b, c = (int(x) for x in m.groups())
    if a > 255 or b > 255 or c > 255:
        return "an octet above 255"
    if not (a == 10 or (a == 172 and 16 <= b <= 31) or (a == 192 and b == 168)):
        return "not inside a private range (10/8, 172.16/12, 192.168/16)"
    return ""


def check_config(cfg):
    """Every argument, before anything is made: a bad one is one line on stderr, exit 2."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,11}", cfg.prefix):
        die(2, "--prefix must be 1-12 characters of [A-Za-z0-9_-], not starting with '-' (interface "
               f"names are at most 15; got '{cfg.prefix}')")
    if cfg.prefix[-1].isdigit():
        die(2, f"--prefix must not end with a digit (host names are PREFIX<number>; got '{cfg.prefix}')")
    why = subnet_problem(cfg.subnet)
    if why:
        die(2, f"--subnet must be the first three octets of a private /24, e.g. {DEFAULT_SUBNET} "
               f"(got '{cfg.subnet}': {why})")
    if not re.fullmatch(r"[1-9][0-9]{0,3}", cfg.slots):
        die(2, f"--slots must be an integer 1..9999 (got '{cfg.slots}')")
    if cfg.host and not (re.fullmatch(r"0|[1-9][0-9]?", cfg.host)
                         or re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,3}){3}", cfg.host)
                         or re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,14}", cfg.host)):
        die(2, f"--host must be a host's index, address or namespace name (got '{cfg.host}')")
    s = cfg.shaping
    if s.rate and not (re.fullmatch(r"[0-9]+(\.[0-9]+)?(|k|m|g|t|ki|mi|gi|ti)(bit|bps)", s.rate, re.I)
                       and not re.match(r"0+(\.0+)?[a-z]", s.rate, re.I)):
        die(2, f"malformed --rate '{s.rate}' (a positive number with a unit: bit kbit mbit gbit tbit, or bps "
               "kbps mbps gbps = bytes/s; e.g. 1gbit, 200mbit)")
    if s.delay and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(s|sec|secs|ms|msec|msecs|us|usec|usecs)", s.delay, re.I):
        die(2, f"malformed --delay '{s.delay}' (a number with a unit: s ms us; e.g. 1ms)")
    if s.loss:
        m = re.fullmatch(r"([0-9]+(\.[0-9]+)?)%?", s.loss)
        if not m or float(m.group(1)) > 100:
            die(2, f"malformed --loss '{s.loss}' (a percentage 0..100, e.g. 5%)")
        s.loss = m.group(1) + "%"
    s.rate, s.delay = s.rate.lower(), s.delay.lower()

    if not cfg.dir:
        cfg.dir = os.path.join(ROOT, "build", "hosts")
    if not cfg.dir.startswith("/"):
        cfg.dir = f"{os.getcwd()}/{cfg.dir}"
    if cfg.command == "up":  # up will make DIR: it, or its nearest existing parent, must be a writable folder
        d = cfg.dir
        while not os.path.lexists(d) and d != "/":
            d = os.path.dirname(d)
        if not (os.path.isdir(d) and os.access(d, os.W_OK)):
            die(2, f"--dir {cfg.dir}: {d} is not a writable folder")


# ---- the record of what up made -------------------------------------------------------------------
@dataclasses.dataclass
class Item:
    """One thing up made, as a line of the record says it."""
    kind: str       # bridge, route, netns or veth
    name: str       # the bridge's, namespace's or root veth end's name; route: its CIDR
    id: str         # bridge, veth: ifindex; netns: inode; route: its device
    extra: str = ""  # veth: the namespace of its peer (that namespace's IFACE)

    def line(self):  # an id that could not be read is '-', which matches nothing
        return " ".join([self.kind, self.name, self.id or "-"] + ([self.extra] if self.extra else []))

    def describe(self):
        """How the messages name it."""
        return {"netns": f"namespace {self.name}", "bridge": f"bridge {self.name}",
                "veth": f"veth pair {self.name} / {self.extra}'s {IFACE}",
                "route": f"route {self.name} dev {self.id}"}.get(self.kind, self.line())


@dataclasses.dataclass
class Record:
    token: str
    subnet: str
    dir: str
    items: list


class StateFile:
    """STATE_ROOT/PREFIX/state, one line per thing, appended by up as soon as the thing exists:
      distca-hosts-state 1
      token T               the set's mark is the alias TAG:PREFIX:T (T: 8+ hex digits)
      subnet A.B.C
      dir DIR               where up wrote hostfile, hosts.env, hosts.json
      bridge NAME IFINDEX   the bridge, in this namespace
      route CIDR DEV        the bridge address's route (it goes with the bridge)
      netns NAME INODE      a host: its inode under NETNS_DIR; its lo carries the mark
      veth NAME IFINDEX NS  the root end of NS's pair; its peer is NS's IFACE
    Lines starting with # are comments. (scripts/hosts.sh, which this replaced, wrote the same
    format, so its records are read as they are.)"""

    def __init__(self, prefix):
        self.prefix = prefix
        self.folder = os.path.join(STATE_ROOT, prefix)
        self.path = os.path.join(self.folder, "state")

    def exists(self):
        return os.path.isfile(self.path)

    def read(self):
        """The record; None where there is none. A record that is not one: exit 1."""
        if not self.exists():
            return None
        with open(self.path) as f:
            lines = f.read().splitlines()
        first = lines[0] if lines else ""
        if first != STATE_FORMAT:
            die(1, f"{self.path} is not a '{STATE_FORMAT}' record (its first line: '{first}'): remove by "
                   f"hand what it lists, then {self.folder}")
        fields = {"token": "", "subnet": "", "dir": ""}
        items = []
        for line in lines[1:]:
            kind, _, rest = line.partition(" ")
            if kind in fields:
                fields[kind] = rest
            elif kind in ("bridge", "route", "netns", "veth"):
                words = line.split(maxsplit=3) + ["", "", ""]
                items.append(Item(kind, words[1], words[2], words[3]))
        if not re.fullmatch(r"[0-9a-f]{8,}", fields["token"]):
            die(1, f"{self.path} has no valid token line: remove by hand what it lists, then {self.folder}")
        return Record(fields["token"], fields["subnet"], fields["dir"], items)

    def _header(self, record):
        return [STATE_FORMAT,
                f"# scripts/hosts.py up's record of what it made; scripts/hosts.py down --prefix {self.prefix} "
                "removes exactly this",
                f"token {record.token}", f"subnet {record.subnet}", f"dir {record.dir}"]

    def create(self, record):
        os.makedirs(self.folder, exist_ok=True)
        with open(self.path, "w") as f:
            f.write("\n".join(self._header(record)) + "\n")

    def add(self, item):
        """One line more, written before the next thing is made."""
        with open(self.path, "a") as f:
            f.write(item.line() + "\n")

    def keep_only(self, record, items):
        """What is left of the record after a down: ITEMS, or nothing (the record and its folders go)."""
        if items:
            with open(self.path + ".new", "w") as f:
                f.write("\n".join(self._header(record) + [i.line() for i in items]) + "\n")
            os.replace(self.path + ".new", self.path)
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        for folder in (self.folder, STATE_ROOT):
            try:
                os.rmdir(folder)
            except OSError:
                pass


# ---- what is there --------------------------------------------------------------------------------
def link_info(dev, ns=None):
    """(ifindex, the alias's first word or None) of link DEV (in namespace NS); None where it is absent."""
    links = ip_json(["link", "show", "dev", dev], ns)
    if not links:
        return None
    alias = links[0].get("ifalias", "").split()
    return str(links[0].get("ifindex", "")), (alias[0] if alias else None)


def netns_names():
    return [n["name"] for n in ip_json(["netns", "list"]) or [] if "name" in n]


def netns_inode(name):
    try:
        return str(os.stat(os.path.join(NETNS_DIR, name)).st_ino)
    except OSError:
        return ""


def netns_pids(inode):
    """The processes in the network namespace of INODE, named or not."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == f"net:[{inode}]":
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def process_names(pids):
    """'comm(pid) ...' of those of PIDS still running."""
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f"{f.read().strip()}({pid})")
        except OSError:
            pass
    return " ".join(names)


def send_signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_pids(where, inode, pids):
    """TERM, then KILL after 2 s, what runs in the namespace of INODE (PIDS: what was found there)."""
    if not pids:
        return
    print(f"hosts.py: {where}: stopping what still runs there: {process_names(pids)}", file=sys.stderr)
    send_signal(pids, signal.SIGTERM)
    for _ in range(10):
        pids = netns_pids(inode)
        if not pids:
            return
        time.sleep(0.2)
    send_signal(pids, signal.SIGKILL)


def routes_to(cidr, dev=None):
    """This namespace's IPv4 routes to CIDR (through DEV), as `ip -o` prints them."""
    proc = run(["ip", "-o", "-4", "route", "show", "to", cidr] + (["dev", dev] if dev else []), check=False)
    return [line for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def link_exists(dev):
    return link_info(dev) is not None


def ipv4_addr(dev, ns=None, with_prefixlen=False):
    """DEV's first IPv4 address (in NS), '' for none."""
    for link in ip_json(["-4", "addr", "show", "dev", dev], ns) or []:
        for a in link.get("addr_info", []):
            if a.get("family") == "inet" and "local" in a:
                return f"{a['local']}/{a['prefixlen']}" if with_prefixlen else a["local"]
    return ""


def host_link(ns):
    links = ip_json(["link", "show", "dev", IFACE], ns)
    return "up" if links and "UP" in links[0].get("flags", []) else "down"


def host_qdisc(ns):
    """The root qdisc of NS's IFACE as tc prints it, without 'qdisc', 'root' and its refcnt."""
    proc = run(in_netns(ns, ["tc", "qdisc", "show", "dev", IFACE, "root"]), check=False)
    first = proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout else ""
    first = re.sub(r"^qdisc ", "", first)
    return re.sub(r" root refcnt [0-9]*", "", first).rstrip()


def host_shaping(ns):
    """{rate, delay, loss} from the alias of NS's IFACE (None for none)."""
    links = ip_json(["link", "show", "dev", IFACE], ns)
    words = links[0].get("ifalias", "").split()[1:] if links else []
    shaping = {"rate": None, "delay": None, "loss": None}
    for word in words:
        key, _, value = word.partition("=")
        if key in shaping:
            shaping[key] = None if value in ("", "-") else value
    return shaping


# ---- ownership: what the record lists and still carries the mark ----------------------------------
class OwnSet:
    """The hosts of a record: what it lists is this program's while it still carries the mark (a
    namespace: and has the recorded inode; a link: the recorded ifindex). An absent alias never matches."""

    def __init__(self, prefix, record):
        self.record = record
        self.mark = f"{TAG}:{prefix}:{record.token}"

    def link_ours(self, name, ifindex):
        return link_info(name) == (ifindex, self.mark)

    def netns_ours(self, name, inode):
        if netns_inode(name) != inode:
            return False
        info = link_info("lo", name)
        return info is not None and info[1] == self.mark

    def pids_marked(self, pids):
        """Those of PIDS whose namespace's lo carries the mark (a namespace deleted by hand, kept by its processes)."""
        marked = []
        for pid in pids:
            proc = run(["nsenter", "-t", str(pid), "-n", "ip", "-j", "link", "show", "dev", "lo"], check=False)
            try:
                alias = json.loads(proc.stdout)[0].get("ifalias", "").split() if proc.returncode == 0 else []
            except (json.JSONDecodeError, IndexError):
                alias = []
            if alias and alias[0] == self.mark:
                marked.append(pid)
        return marked

    def item_state(self, item):
        """ours (recorded and marked), gone, or other (its name now holds something up did not make)."""
        if item.kind == "netns":
            if not os.path.lexists(os.path.join(NETNS_DIR, item.name)):
                return "gone"
            return "ours" if self.netns_ours(item.name, item.id) else "other"
        if item.kind in ("bridge", "veth"):
            if not link_exists(item.name):
                return "gone"
            return "ours" if self.link_ours(item.name, item.id) else "other"
        if item.kind == "route":  # the route is the recorded bridge's while that bridge is
            bridge = next((i for i in self.record.items if i.kind == "bridge"), None)
            if bridge is None or self.item_state(bridge) != "ours":
                return "other" if link_exists(item.id) else "gone"
            return "ours" if routes_to(item.name, item.id) else "gone"
        return "other"

    def hosts(self):
        """The recorded namespaces that are still this program's, in the record's order."""
        return [i.name for i in self.record.items if i.kind == "netns" and self.netns_ours(i.name, i.id)]

    def teardown(self, state):
        """Removes what the record lists and is still this program's; one line on stderr for each
        thing that was already gone, is held by something else, or could not be removed (kept in
        the record). Returns the number of such things."""
        items = self.record.items
        # 1. What is there, before anything is removed: what is missing now went outside this program.
        before = [self.item_state(i) for i in items]
        # 2. The namespaces, with what runs in them. A recorded namespace deleted by hand lives on while
        #    a process holds it (with its veth pair on the bridge): its processes are found by inode
        #    and stopped when that namespace's lo carries the mark.
        for item, was in zip(items, before):
            if item.kind != "netns":
                continue
            if was == "ours":
                stop_pids(item.name, item.id, netns_pids(item.id))
                run(["ip", "netns", "del", item.name], check=False)
            elif was == "gone":
                stop_pids(f"{item.name} (deleted by hand, kept alive by its processes)", item.id,
                          self.pids_marked(netns_pids(item.id)))
        # 3. The veth pairs (each namespace's deletion takes its own along, a moment later) and the bridge.
        for item, was in zip(items, before):
            if item.kind not in ("bridge", "veth") or was != "ours":
                continue
            for _ in range(10):
                if not self.link_ours(item.name, item.id):
                    break
                run(["ip", "link", "del", item.name], check=False)
                if not self.link_ours(item.name, item.id):
                    break
                time.sleep(0.2)
        # 4. One line for each thing that was not removed here, and the record keeps what is left.
        problems = 0
        left = []
        for item, was in zip(items, before):
            now = self.item_state(item)
            if was == "ours" and now == "ours":
                print(f"hosts.py: left: {item.describe()}: could not be removed", file=sys.stderr)
                left.append(item)
            elif was == "gone":
                print(f"hosts.py: already gone: {item.describe()} (removed outside scripts/hosts.py)", file=sys.stderr)
            elif was == "other":
                print(f"hosts.py: left alone: {item.describe()}: the name now holds something scripts/hosts.py "
                      "did not make", file=sys.stderr)
            if not (was == "ours" and now != "ours"):
                problems += 1
        state.keep_only(self.record, left)
        return problems


def names_in_use(prefix, n=None):
    """What has PREFIX's names (with N: the names up N makes) and is not in the record, as
    'namespace X, link Y'; nothing here is touched."""
    def numbered(suffix):  # a host number: with N, one below N written without leading zeros
        if not re.fullmatch(r"[0-9]+", suffix):
            return False
        return n is None or (str(int(suffix)) == suffix and int(suffix) < n)

    found = [f"namespace {name}" for name in netns_names()
             if name.startswith(prefix) and numbered(name[len(prefix):])]
    for link in ip_json(["link", "show"]) or []:
        name = link.get("ifname", "")
        k = name[len(prefix):]
        if name.startswith(prefix) and (k == "br" or (k.startswith("v") and numbered(k[1:]))):
            found.append(f"link {name}")
    return ", ".join(found)


def load_hosts(cfg):
    """(the record's OwnSet or None, the namespaces of the prefix's hosts that are still ours)."""
    record = StateFile(cfg.prefix).read()
    if record is None:
        return None, []
    own = OwnSet(cfg.prefix, record)
    return own, own.hosts()


def resolve_host(cfg, hosts, sel):
    """The namespace of host SEL (index, address or namespace name) among HOSTS; exit 1 where none."""
    if re.fullmatch(r"[0-9]+", sel):
        ns = f"{cfg.prefix}{int(sel)}"
    elif re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+", sel):
        for ns in hosts:
            if ipv4_addr(IFACE, ns) == sel:
                return ns
        die(1, f"no host of prefix {cfg.prefix} has address {sel} (scripts/hosts.py status)")
    else:
        ns = sel
    if ns not in hosts:
        die(1, f"no host '{sel}' (namespace {ns}) of prefix {cfg.prefix} (scripts/hosts.py status)")
    return ns


def need_root(cfg):
    why = ip_problem()
    if why:
        die(1, why)
    if not is_root_capable():
        die(1, f"{cfg.command} needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")


# ---- shaping ----------------------------------------------------------------------------------------
@functools.cache
def have_netem():
    """Probed in a throwaway namespace (unshare -n): nothing is left behind."""
    return run(["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem"], check=False).returncode == 0


def have_htb_bpf():
    """htb with a cls_bpf filter, probed on lo of a throwaway namespace."""
    batch = ("qdisc add dev lo root handle 1: htb default 10\n"
             'filter add dev lo parent 1: protocol all prio 1 bpf bytecode "1,6 0 0 0" classid 1:20\n')
    return run(["unshare", "-n", "tc", "-batch", "-"], check=False, stdin=batch).returncode == 0


def check_shaping_support(shaping):
    """Exit 77 where the requested shaping cannot be done on this kernel."""
    if not shaping:
        return
    if shutil.which("tc") is None:
        skip("no 'tc' (iproute2) to shape the links")
    if have_netem():
        return
    if shaping.delay:
        skip("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), which --delay needs (--rate and --loss "
             "work without it)")
    if not have_htb_bpf():
        skip("this kernel has neither netem nor htb + cls_bpf, which --rate/--loss need")


def rate_bytes(rate):
    """Bytes/s of a tc rate (bit: bits/s; bps: bytes/s; k m g t by 1000, ki mi gi ti by 1024)."""
    r = rate.lower()
    in_bytes = r.endswith("bps")
    r = re.sub(r"(bit|bps)$", "", r)
    base = 1000
    if r.endswith("i"):
        base, r = 1024, r[:-1]
    power = {"k": 1, "m": 2, "g": 3, "t": 4}.get(r[-1:], 0)
    if power:
        r = r[:-1]
    value = float(r) * base ** power
    return value if in_bytes else value / 8


def seconds(time_text):
    """Seconds of a tc time (s, ms, us and their spellings)."""
    m = re.fullmatch(r"([0-9.]+)(.*)", time_text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1e6 if unit.startswith("u") else value / 1e3 if unit.startswith("m") else value


def netem_limit(shaping):
    """netem's queue, in packets: its default 1000, or twice the bandwidth-delay product (at 10gbit without --rate)."""
    limit = int(2 * rate_bytes(shaping.rate or "10gbit") * seconds(shaping.delay or "0s") / 1500) + 1
    return max(limit, 1000)


def apply_shape(own, ns, shaping):
    """Replaces NS's IFACE qdisc with SHAPING (none: the default qdisc), noted in its alias."""
    def tc(*args):
        run(in_netns(ns, ["tc"] + list(args)))

    run(in_netns(ns, ["tc", "qdisc", "del", "dev", IFACE, "root"]), check=False)
    alias = own.mark
    if shaping:
        if have_netem():
            args = ["limit", str(netem_limit(shaping))]
            if shaping.delay:
                args += ["delay", shaping.delay]
            if shaping.rate:
                args += ["rate", shaping.rate]
            if shaping.loss:
                args += ["loss", "random", shaping.loss]
            tc("qdisc", "add", "dev", IFACE, "root", "handle", "1:", "netem", *args)
        else:  # htb: class 1:10 at the rate; loss: a cBPF filter sends P% of the packets to 1:20, whose pfifo holds 0
            # Burst: one GSO packet (64 KB) and a frame, whatever the rate: a larger one lets every
            # exchange's first burst bytes through at the veth's own speed (at 1gbit, bps / 250 = 500 KB
            # made a 2 MB exchange 25 % faster than the rate), which the shaped rate must not allow.
            burst = "66000"
            tc("qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb", "default", "10")
            tc("class", "add", "dev", IFACE, "parent", "1:", "classid", "1:10", "htb", "rate",
               shaping.rate or "100gbit", "burst", burst, "cburst", burst, "quantum", "65536")
            if shaping.loss:
                threshold = "%.0f" % min(float(shaping.loss.rstrip("%")) / 100 * 4294967296, 4294967295)
                tc("class", "add", "dev", IFACE, "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit",
                   "quantum", "1514")
                tc("qdisc", "add", "dev", IFACE, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
                # A = random u32; A >= threshold: return 0 (no match: default class 1:10);
                # else -1 (the filter's class 1:20)
                tc("filter", "add", "dev", IFACE, "parent", "1:", "protocol", "all", "prio", "1", "bpf", "bytecode",
                   f"4,32 0 0 4294963256,53 1 0 {threshold},6 0 0 4294967295,6 0 0 0", "classid", "1:20")
        alias = f"{alias} {shaping.describe()}"
    run(["ip", "-n", ns, "link", "set", "dev", IFACE, "alias", alias])


# ---- the files up writes ------------------------------------------------------------------------------
def shell_quote(word):
    """A single-quoted shell word."""
    return "'" + word.replace("'", "'\\''") + "'"


def mpirun_flags(subnet):
    # routed direct: every daemon talks to mpirun itself. (No plm_rsh_no_tree_spawn: with it Open MPI
    # starts the daemons with --daemonize, so a daemon that cannot reach mpirun goes unnoticed and
    # mpirun waits forever, and a daemon outlives a killed mpirun.)
    flags = ["--mca plm rsh", f"--mca plm_rsh_agent {AGENT}", "--mca routed direct",
             "--mca oob tcp", f"--mca oob_tcp_if_include {subnet}.0/24",
             # a daemon whose link drops is declared lost after 5 s idle + 5 unanswered probes 1 s
             # apart, and the job ends (without this, mpirun waits on TCP retransmissions for many minutes)
             "--mca oob_tcp_keepalive_time 5", "--mca oob_tcp_keepalive_intvl 1", "--mca oob_tcp_keepalive_probes 5",
             "--mca pml ob1", "--mca btl tcp,self", f"--mca btl_tcp_if_include {subnet}.0/24", "--mca osc ^ucx"]
    return " ".join(flags)


def env_prefix_line(prefix):
    """The line of hosts.env that says whose it is (down removes only a DIR whose hosts.env has it)."""
    return f"DISTCA_HOSTS_PREFIX={shell_quote(prefix)}"


def write_files(cfg, n):
    """DIR/hostfile (Open MPI's), DIR/hosts.env (to source), DIR/hosts.json."""
    namespaces = [f"{cfg.prefix}{k}" for k in range(n)]
    addrs = [f"{cfg.subnet}.{k + 1}" for k in range(n)]
    hostfile = os.path.join(cfg.dir, "hostfile")
    flags = mpirun_flags(cfg.subnet)
    s = cfg.shaping
    os.makedirs(cfg.dir, exist_ok=True)
    with open(hostfile, "w") as f:
        f.writelines(f"{a} slots={cfg.slots}\n" for a in addrs)
    env = [
        ("DISTCA_HOSTS_N", str(n)),
        ("DISTCA_HOSTS_SUBNET", cfg.subnet),
        ("DISTCA_HOSTS_ADDRS", " ".join(addrs)),
        ("DISTCA_HOSTS_NAMESPACES", " ".join(namespaces)),
        ("DISTCA_HOSTS_IFACE", IFACE),
        ("DISTCA_HOSTS_BRIDGE", cfg.bridge),
        ("DISTCA_HOSTS_BRIDGE_ADDR", cfg.bridge_addr),
        ("DISTCA_HOSTS_SLOTS", cfg.slots),
        ("DISTCA_HOSTS_HOSTFILE", hostfile),
        ("DISTCA_HOSTS_RATE", s.rate),
        ("DISTCA_HOSTS_DELAY", s.delay),
        ("DISTCA_HOSTS_LOSS", s.loss),
        ("DISTCA_HOSTS_AGENT", AGENT),
    ]
    with open(os.path.join(cfg.dir, "hosts.env"), "w") as f:
        f.write("# written by scripts/hosts.py up (source it; scripts/hosts.py down removes it)\n")
        f.write(env_prefix_line(cfg.prefix) + "\n")
        f.writelines(f"{name}={shell_quote(value)}\n" for name, value in env)
        f.write('# mpirun $DISTCA_MPIRUN_HOST_FLAGS --hostfile "$DISTCA_HOSTS_HOSTFILE" ... '
                '(unquoted: one word per flag)\n')
        f.write(f"DISTCA_MPIRUN_HOST_FLAGS={shell_quote(flags)}\n")
    doc = {
        "prefix": cfg.prefix, "n": n, "subnet": cfg.subnet, "interface": IFACE,
        "bridge": cfg.bridge, "bridge_addr": cfg.bridge_addr, "slots": int(cfg.slots),
        "hostfile": hostfile, "agent": AGENT,
        "shaping": {"rate": s.rate or None, "delay": s.delay or None, "loss": s.loss or None,
                    "qdisc": ("netem" if have_netem() else "htb") if s else None},
        "hosts": [{"index": k, "namespace": namespaces[k], "addr": addrs[k], "slots": int(cfg.slots)}
                  for k in range(n)],
        "mpirun_host_flags": flags,
    }
    with open(os.path.join(cfg.dir, "hosts.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return namespaces, addrs


def remove_files(folder, prefix):
    """The files up wrote in FOLDER, where they are PREFIX's (its hosts.env says so); FOLDER if then empty."""
    env = os.path.join(folder, "hosts.env")
    try:
        with open(env) as f:
            ours = env_prefix_line(prefix) in f.read().splitlines()
    except OSError:
        return
    if not ours:
        return
    for name in ("hostfile", "hosts.env", "hosts.json"):
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


# ---- commands -----------------------------------------------------------------------------------------
def check_namespaces_possible(shaping):
    """Exit 77 where network namespaces (or the shaping asked for) cannot be made here; makes nothing."""
    why = ip_problem()
    if why:
        skip(f"{why} on this machine")
    if not is_root_capable():
        skip("making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as uid "
             f"{os.getuid()} without them")
    proc = subprocess.run(["ip", "netns", "list"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        skip(f"'ip netns' does not work here: {(proc.stderr.splitlines() or [''])[0]}")
    if shutil.which("unshare") is None:
        skip("no 'unshare' (util-linux) to check namespace support")
    batch = "link add pa type veth peer name pb\nlink add pbr type bridge\nlink set pa master pbr\n"
    proc = subprocess.run(["unshare", "-n", "ip", "-batch", "-"], input=batch, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        skip("this kernel/container cannot make veth pairs and bridges in a network namespace: "
             f"{' '.join(proc.stderr.split()) or 'unshare -n failed'}")
    check_shaping_support(shaping)


def make_hosts(cfg, state, own, n):
    """Makes the bridge and N hosts, each thing's line added to the record as soon as it exists."""
    def ip(*args):
        run(["ip"] + list(args))

    ip("link", "add", cfg.bridge, "type", "bridge")
    try:
        ip("link", "set", "dev", cfg.bridge, "alias", own.mark)
    except CommandFailed:
        run(["ip", "link", "del", cfg.bridge], check=False)
        raise
    state.add(Item("bridge", cfg.bridge, link_info(cfg.bridge)[0]))
    ip("addr", "add", f"{cfg.bridge_addr}/24", "dev", cfg.bridge)
    state.add(Item("route", cfg.cidr, cfg.bridge))
    ip("link", "set", "dev", cfg.bridge, "up")
    for k in range(n):
        ns, veth = f"{cfg.prefix}{k}", f"{cfg.prefix}v{k}"
        ip("netns", "add", ns)
        try:
            ip("-n", ns, "link", "set", "dev", "lo", "alias", own.mark)
        except CommandFailed:
            run(["ip", "netns", "del", ns], check=False)
            raise
        state.add(Item("netns", ns, netns_inode(ns)))
        ip("-n", ns, "link", "set", "dev", "lo", "up")
        ip("link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", ns)  # deleting ns takes it along
        ip("link", "set", "dev", veth, "alias", own.mark)
        ip("-n", ns, "link", "set", "dev", IFACE, "alias", own.mark)
        state.add(Item("veth", veth, link_info(veth)[0], ns))
        ip("link", "set", "dev", veth, "master", cfg.bridge)
        ip("link", "set", "dev", veth, "up")
        ip("-n", ns, "addr", "add", f"{cfg.subnet}.{k + 1}/24", "dev", IFACE)
        ip("-n", ns, "link", "set", "dev", IFACE, "up")
        apply_shape(own, ns, cfg.shaping)


def cmd_up(cfg):
    if len(cfg.positional) != 1:
        die(2, f"up takes one argument N (the number of hosts, 1..{MAX_HOSTS})")
    n_text = cfg.positional[0]
    if not (re.fullmatch(r"[1-9][0-9]?", n_text) and int(n_text) <= MAX_HOSTS):
        die(2, f"N must be an integer 1..{MAX_HOSTS} (got '{n_text}')")
    n = int(n_text)
    check_namespaces_possible(cfg.shaping)

    # The set up made before with this prefix: made anew. What is left of it stops up.
    state = StateFile(cfg.prefix)
    earlier = state.read()
    if earlier is not None and OwnSet(cfg.prefix, earlier).teardown(state) and state.exists():
        die(1, f"the earlier hosts of prefix {cfg.prefix} could not all be removed (above; {state.path} lists them)")
    # Names that something else holds are left alone, and stop up before it makes anything.
    in_use = names_in_use(cfg.prefix, n)
    if in_use:
        die(1, f"not made by scripts/hosts.py, left alone: {in_use}; remove them or choose another --prefix")
    routes = routes_to(cfg.cidr)
    if routes:
        die(1, f"subnet {cfg.cidr} is already routed here ({routes[0]}): choose another --subnet")

    # The record first, then each thing, its line added as soon as it exists; on any failure (or
    # an interruption), what the record lists is removed.
    record = Record(os.urandom(6).hex(), cfg.subnet, cfg.dir, [])
    own = OwnSet(cfg.prefix, record)
    try:
        state.create(record)
        make_hosts(cfg, state, own, n)
        namespaces, addrs = write_files(cfg, n)
    except BaseException as err:
        what = str(err) if isinstance(err, (CommandFailed, OSError)) else type(err).__name__
        print(f"hosts.py: up failed ({what}); removing what it made", file=sys.stderr)
        own.record = state.read() or record
        own.teardown(state)
        remove_files(cfg.dir, cfg.prefix)
        if isinstance(err, (CommandFailed, OSError)):
            sys.exit(1)
        raise
    shaped = f", shaped: {cfg.shaping.describe()}" if cfg.shaping else ""
    print(f"hosts.py: {n} hosts up: {' '.join(namespaces)} ({' '.join(addrs)}) on {cfg.bridge} "
          f"({cfg.bridge_addr}){shaped}; files in {cfg.dir}")


def cmd_down(cfg):
    if cfg.positional:
        die(2, "down takes no arguments")
    state = StateFile(cfg.prefix)
    folders = [cfg.dir] if "dir" in cfg.given else []
    problems = 0
    if state.exists():
        need_root(cfg)
        record = state.read()
        problems = OwnSet(cfg.prefix, record).teardown(state)
        if "dir" not in cfg.given and record.dir:
            folders.append(record.dir)
    elif "dir" not in cfg.given:
        folders.append(cfg.dir)
    if not ip_problem():  # iproute2 is here
        in_use = names_in_use(cfg.prefix)
        if in_use:
            print(f"hosts.py: not in {state.path}, so not made by scripts/hosts.py and left alone: {in_use}",
                  file=sys.stderr)
    for folder in folders:
        remove_files(folder, cfg.prefix)
    if problems:
        die(1, f"down: the hosts of prefix {cfg.prefix} were not whole: removed the rest; {problems} recorded "
               "thing(s) already gone or left (one line each above)")


def cmd_shape(cfg):
    if cfg.positional:
        die(2, "shape takes no arguments (--host K for one host)")
    if cfg.clear and cfg.shaping:
        die(2, "shape: --clear with --rate/--delay/--loss")
    if not cfg.clear and not cfg.shaping:
        die(2, "shape: give --rate, --delay and/or --loss, or --clear")
    need_root(cfg)
    own, hosts = load_hosts(cfg)
    if not hosts:
        die(1, f"no hosts of prefix {cfg.prefix} (scripts/hosts.py up N)")
    check_shaping_support(cfg.shaping)
    targets = [resolve_host(cfg, hosts, cfg.host)] if cfg.host else hosts
    for ns in targets:
        apply_shape(own, ns, cfg.shaping)


def cmd_link(cfg):
    updown = cfg.command.removeprefix("link-")
    if len(cfg.positional) != 1:
        die(2, f"{cfg.command} takes one argument K (host index, address or namespace)")
    need_root(cfg)
    _, hosts = load_hosts(cfg)
    ns = resolve_host(cfg, hosts, cfg.positional[0])
    run(["ip", "-n", ns, "link", "set", "dev", IFACE, updown])
    print(f"hosts.py: {ns} ({ipv4_addr(IFACE, ns)}) {IFACE} {updown}")


def cmd_status(cfg):
    if cfg.positional:
        die(2, "status takes no arguments")
    why = ip_problem()
    if why:
        die(1, why)
    _, hosts = load_hosts(cfg)
    bridge_addr = ipv4_addr(cfg.bridge, with_prefixlen=True)
    rows = [{"index": int(ns[len(cfg.prefix):]), "namespace": ns, "addr": ipv4_addr(IFACE, ns) or None,
             "link": host_link(ns), **host_shaping(ns), "qdisc": host_qdisc(ns) or None} for ns in hosts]
    if cfg.json:
        print(json.dumps({"prefix": cfg.prefix, "n": len(hosts), "bridge": cfg.bridge if bridge_addr else None,
                          "bridge_addr": bridge_addr.split("/")[0] or None, "hosts": rows}, indent=2))
        return
    if not hosts:
        print(f"no hosts of prefix {cfg.prefix}")
        return
    print(f"{len(hosts)} hosts of prefix {cfg.prefix} on bridge {cfg.bridge} ({bridge_addr or 'no address'})")
    line = "{:<5} {:<16} {:<15} {:<5} {:<9} {:<7} {:<7} {}"
    print(line.format("HOST", "NAMESPACE", "ADDRESS", "LINK", "RATE", "DELAY", "LOSS", "QDISC"))
    for r in rows:
        print(line.format(r["index"], r["namespace"], r["addr"] or "", r["link"], r["rate"] or "-",
                          r["delay"] or "-", r["loss"] or "-", r["qdisc"] or ""))


def main(argv):
    cfg = parse_command_line(argv)
    check_config(cfg)

    def terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
    command = {"up": cmd_up, "down": cmd_down, "shape": cmd_shape, "link-down": cmd_link, "link-up": cmd_link,
               "status": cmd_status}[cfg.command]
    try:
        command(cfg)
    except CommandFailed as err:  # not silent, whatever fails: the command and its exit status
        die(1, f"{cfg.command} failed: {err}")
    except KeyboardInterrupt:
        print(f"hosts.py: {cfg.command} interrupted", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print(f"hosts.py: {cfg.command} terminated", file=sys.stderr)
        sys.exit(143)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
