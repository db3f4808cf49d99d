"""Real unprivileged Unix users for the hostile-user suite (``-m security``).

The agent runs as root on what users write, so every trust boundary is tested
with the attacker's steps done by a real user: a uid with no privileges,
created here with ``useradd`` and removed when the session ends. Commands run
as that user through ``setpriv`` (util-linux), which changes uid, gid and
supplementary groups and nothing else.
"""
from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from typing import Sequence

PREFIX = "rsec"


@dataclass(frozen=True)
class UnixUser:
    name: str
    uid: int
    gid: int

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run as this user (for an argv seam such as SlurmRunner)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                "--", *command]

    def run(self, command: Sequence[str], check: bool = True, timeout: float = 60,
            env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        environ = dict(os.environ if env is None else env, HOME="/tmp", USER=self.name,
                       LOGNAME=self.name)
        return subprocess.run(self.argv(command), capture_output=True, text=True,
                              timeout=timeout, check=check, env=environ, **kw)


class Users:
    """Creates users on first use, named ``rsec<pid><role>`` so that two test
    sessions on one machine never share one; :meth:`remove_all` deletes them."""

    def __init__(self) -> None:
        self.made: dict[str, UnixUser] = {}

    def __call__(self, role: str) -> UnixUser:
        if role not in self.made:
            if os.geteuid() != 0:
                raise RuntimeError("the hostile-user suite creates Unix users: run it as root")
            name = f"{PREFIX}{os.getpid()}{role}"[:32]
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--no-create-home", "--user-group",
                                "--shell", "/bin/sh", name], check=True, capture_output=True,
                               timeout=60)
            entry = pwd.getpwnam(name)
            self.made[role] = UnixUser(name, entry.pw_uid, entry.pw_gid)
        return self.made[role]

    def remove_all(self) -> None:
        for user in self.made.values():
            subprocess.run(["userdel", user.name], capture_output=True, timeout=60,
                           check=False)
        self.made.clear()
