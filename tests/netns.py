"""Hosts of a farm in network namespaces of their own, joined by a switch whose links can be slowed, made lossy or
cut: the harness of the multi-host tests (tests/test_two_hosts.py, tests/test_netfaults.py) and of
bench/netfaults.py.

Each host is a namespace with one interface (a TAP device) and an address on a private /24; the test process
itself is one more host ("client", its TAP left in the root namespace) so it reaches the hosts' addresses as
any machine on the network would. The switch is a small user-space learning switch in a process of its own
(`python -m tests.netns`): it holds every TAP's file descriptor and forwards Ethernet frames between them, applying
per-link rules (delay, loss, down) set through its stdin.

Why not a kernel bridge with `tc netem`: the kernels this runs on (and CI's) may lack sch_netem, the gact action
and the nft/iptables tools (this one has none of them); a user-space switch needs only TUN/TAP and behaves the
same for TCP: frames delayed or dropped in the middle of the network, never reported to the sender's stack (netem
on a sending host reports local drops to TCP, which then hides them). A cut link drops frames silently in both
directions, as a partition does: connections hang until a timeout or keepalive notices.

Names carry a random tag (namespaces `fn<tag>-<host>`, TAPs `ft<tag><i>`) and the /24 is one no route of this
machine uses yet, so concurrent runs never collide; `close()` (also on a failed test, through the fixture that
owns the Net) deletes the namespaces and stops the switch, whose exit removes the TAPs.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import ipaddress
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
CLIENT = "client"  # the test process's own host (its TAP stays in the root namespace)
ANY = "*"
MTU = 9000

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def sh(*args: str) -> str:
    """Run a command; its stdout. Raises with the command's stderr on failure."""
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def unavailable() -> str | None:
    """Why namespaces and TAPs cannot be made here (a reason to skip with), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (ip)"
    if not os.path.exists("/dev/net/tun"):
        return "the switch needs TUN/TAP (/dev/net/tun)"
    probe = f"fnprobe{uuid.uuid4().hex[:6]}"
    try:
        sh("ip", "netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create network namespaces here: {e}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Link:
    """What the switch does to frames from one host to another: `delay_s` added, a `loss` fraction dropped, all
    dropped while `down`."""

    delay_s: float = 0.0
    loss: float = 0.0
    down: bool = False


class Net:
    """Hosts in namespaces joined by the switch. `with Net(["redis", "api", "w1"]) as net: net.popen("w1", argv)`."""

    def __init__(self, hosts: Sequence[str], log_dir: Path | None = None):
        if CLIENT in hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"host names must be unique and not {CLIENT!r}")
        self.tag = uuid.uuid4().hex[:6]
        self.hosts = list(hosts)
        self.log_dir = log_dir
        self.subnet = _free_subnet()
        base = int(ipaddress.ip_network(self.subnet).network_address)
        self._ips = {h: str(ipaddress.ip_address(base + i + 1)) for i, h in enumerate(self.hosts)}
        self._ips[CLIENT] = str(ipaddress.ip_address(base + 254))
        self._taps = {h: f"ft{self.tag}{i}" for i, h in enumerate([*self.hosts, CLIENT])}
        self._made: list[str] = []
        self._switch: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> Net:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Net:
        for h in self.hosts:
            sh("ip", "netns", "add", self.ns(h))
            self._made.append(self.ns(h))
        spec = json.dumps({h: self._taps[h] for h in [*self.hosts, CLIENT]})
        from farm.infra.orphans import die_with_parent

        log = (self.log_dir / "switch.log").open("ab") if self.log_dir else subprocess.DEVNULL
        self._switch = subprocess.Popen([sys.executable, "-m", "tests.netns", spec], cwd=ROOT, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                        preexec_fn=die_with_parent())
        if self._read_reply() != "ready":
            raise RuntimeError("the switch did not start")
        prefix = self.subnet.split("/")[1]
        for h in [*self.hosts, CLIENT]:
            tap = self._taps[h]
            ip = ["ip"] if h == CLIENT else ["ip", "-n", self.ns(h)]
            if h != CLIENT:
                sh("ip", "link", "set", tap, "netns", self.ns(h))
                sh(*ip, "link", "set", "lo", "up")
            sh(*ip, "link", "set", tap, "mtu", str(MTU))
            sh(*ip, "addr", "add", f"{self._ips[h]}/{prefix}", "dev", tap)
            sh(*ip, "link", "set", tap, "up")
        return self

    def close(self) -> None:
        """Delete the namespaces (their processes should be stopped first) and stop the switch."""
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
        if self._switch is not None and self._switch.poll() is None:
            self._switch.kill()
            self._switch.wait(10)

    # -- hosts -----------------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"fn{self.tag}-{host}"

    def ip(self, host: str) -> str:
        return self._ips[host]

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` as run on `host` (inside its namespace)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start `argv` on `host`: in its namespace, from the repository root, dying with the test process."""
        from farm.infra.orphans import die_with_parent

        out: Any = log.open("ab") if log is not None else subprocess.DEVNULL
        return subprocess.Popen(self.argv(host, argv), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent(), **kwargs)

    # -- faults ----------------------------------------------------------------------------------------------
    def link(self, src: str, dst: str, *, delay_ms: float = 0.0, loss: float = 0.0, down: bool = False) -> None:
        """Frames from `src` to `dst` (either may be "*") get this delay, loss fraction, or are all dropped."""
        self._send({"op": "set", "src": src, "dst": dst, "delay_s": delay_ms / 1000.0, "loss": loss, "down": down})

    def cut(self, a: str, b: str) -> None:
        """Partition `a` from `b` ("*" = every other host), both directions."""
        self.link(a, b, down=True)
        self.link(b, a, down=True)

    def heal(self) -> None:
        """Every link back to normal (no delay, loss or cut)."""
        self._send({"op": "clear"})

    @contextlib.contextmanager
    def partitioned(self, a: str, b: str) -> Iterator[None]:
        """`a` and `b` partitioned inside the block, healed when it ends (also on an exception)."""
        self.cut(a, b)
        try:
            yield
        finally:
            self.heal()

    def stats(self) -> dict[str, int]:
        """Frames forwarded, dropped by loss and dropped by cut links, since the switch started."""
        return json.loads(self._send({"op": "stats"}))

    def _send(self, cmd: dict[str, Any]) -> str:
        assert self._switch is not None and self._switch.stdin is not None
        self._switch.stdin.write(json.dumps(cmd) + "\n")
        self._switch.stdin.flush()
        return self._read_reply()

    def _read_reply(self) -> str:
        assert self._switch is not None and self._switch.stdout is not None
        line = self._switch.stdout.readline()
        if not line:
            raise RuntimeError(f"the switch exited (status {self._switch.poll()})")
        return line.strip()


def _free_subnet() -> str:
    """A 10.x.y.0/24 no route of this machine covers (the client's TAP adds one in the root namespace)."""
    used = [ipaddress.ip_network(w.split()[0], strict=False) for w in sh("ip", "-4", "route").splitlines()
            if w and w.split()[0][0].isdigit()]
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(100, 250)}.{rng.randrange(1, 250)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise RuntimeError("no free 10.x.y.0/24 for the test network")


# -- the switch process ------------------------------------------------------------------------------------------
class _Switch:
    """A learning Ethernet switch over TAP fds, with per-link rules."""

    def __init__(self, taps: dict[str, str]):
        self.fds: dict[str, int] = {h: _open_tap(name) for h, name in taps.items()}
        self.host_of = {fd: h for h, fd in self.fds.items()}
        self.macs: dict[bytes, str] = {}
        self.rules: dict[tuple[str, str], Link] = {}
        self.delayed: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.counts = {"forwarded": 0, "lost": 0, "cut": 0}
        self.rng = random.Random()

    def rule(self, src: str, dst: str) -> Link | None:
        r = self.rules
        return r.get((src, dst)) or r.get((src, ANY)) or r.get((ANY, dst)) or r.get((ANY, ANY))

    def command(self, cmd: dict[str, Any]) -> str:
        if cmd["op"] == "set":
            self.rules[(cmd["src"], cmd["dst"])] = Link(cmd["delay_s"], cmd["loss"], cmd["down"])
        elif cmd["op"] == "clear":
            self.rules.clear()
        elif cmd["op"] == "stats":
            return json.dumps(self.counts)
        return "ok"

    def frame(self, src: str, data: bytes) -> None:
        if len(data) < 14:
            return
        self.macs[data[6:12]] = src
        dst = self.macs.get(data[0:6]) if not data[0] & 1 else None  # multicast/broadcast: flood
        outs = [dst] if dst is not None else [h for h in self.fds if h != src]
        now = time.monotonic()
        for out in outs:
            if out == src:
                continue
            link = self.rule(src, out)
            if link is not None:
                if link.down:
                    self.counts["cut"] += 1
                    continue
                if link.loss and self.rng.random() < link.loss:
                    self.counts["lost"] += 1
                    continue
                if link.delay_s:
                    self.seq += 1
                    heapq.heappush(self.delayed, (now + link.delay_s, self.seq, self.fds[out], data))
                    continue
            self.write(self.fds[out], data)

    def write(self, fd: int, data: bytes) -> None:
        try:
            os.write(fd, data)
            self.counts["forwarded"] += 1
        except OSError:  # the host's interface is down or its queue full: the frame is lost, as on a wire
            self.counts["lost"] += 1

    def run(self, control: IO[str]) -> None:
        print("ready", flush=True)
        ctl = control.fileno()
        watched = [ctl, *self.fds.values()]
        while True:
            now = time.monotonic()
            while self.delayed and self.delayed[0][0] <= now:
                _, _, fd, data = heapq.heappop(self.delayed)
                self.write(fd, data)
            timeout = max(0.0, self.delayed[0][0] - now) if self.delayed else 1.0
            ready, _, _ = select.select(watched, [], [], timeout)
            for fd in ready:
                if fd == ctl:
                    line = control.readline()
                    if not line:
                        return  # the harness is gone
                    print(self.command(json.loads(line)), flush=True)
                    continue
                for _ in range(64):  # drain what is queued, bounded so no port starves the others
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:
                        break
                    self.frame(self.host_of[fd], data)


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


if __name__ == "__main__":
    _Switch(json.loads(sys.argv[1])).run(sys.stdin)
