"""A network namespace joined to this one by a veth pair with addresses of its own, so a
test can run a process that reaches this machine only at a non-loopback address (a
Spark worker that must reach the driver as a remote executor would). Traffic stays on
the pair: nothing is routed anywhere else. Needs root and iproute2's ``ip``."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> str:
    ip = shutil.which("ip")
    if ip is None:
        raise RuntimeError("the network-namespace tests need iproute2's `ip`: apt-get install iproute2")
    out = subprocess.run([ip, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()} "
                           "(network namespaces need root)")
    return out.stdout


@dataclass
class VethNamespace:
    """``name``: the namespace; ``host_address`` is this side of the pair, ``ns_address``
    the namespace's (a /30 of 10.213.0.0/16 picked from the pid, so runs do not clash)."""

    name: str
    host_link: str
    host_address: str
    ns_address: str

    @classmethod
    def create(cls) -> VethNamespace:
        tag = f"{os.getpid() % 100_000:05d}"
        block = (os.getpid() % 16_000) * 4
        base = f"10.213.{block // 256}.{block % 256}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        ns = cls(f"volley-{tag}", f"vvh{tag}", f"{prefix}.{last + 1}", f"{prefix}.{last + 2}")
        ns_link = f"vvn{tag}"
        _ip("netns", "add", ns.name)
        try:
            _ip("link", "add", ns.host_link, "type", "veth", "peer", "name", ns_link)
            _ip("link", "set", ns_link, "netns", ns.name)
            _ip("addr", "add", f"{ns.host_address}/30", "dev", ns.host_link)
            _ip("link", "set", ns.host_link, "up")
            _ip("netns", "exec", ns.name, "ip", "addr", "add", f"{ns.ns_address}/30", "dev", ns_link)
            _ip("netns", "exec", ns.name, "ip", "link", "set", ns_link, "up")
            _ip("netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
        except BaseException:
            ns.delete()
            raise
        return ns

    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *args]

    def pids(self) -> set[int]:
        return {int(p) for p in _ip("netns", "pids", self.name).split()}

    def delete(self) -> None:
        for args in (("link", "del", self.host_link), ("netns", "del", self.name)):
            try:
                _ip(*args)
            except RuntimeError:
                pass  # already gone
