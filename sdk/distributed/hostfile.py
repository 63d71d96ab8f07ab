"""DeepSpeed's hostfile and resource filters, and the variables a job over ssh takes to every host.

    # hostfile: one machine a line, "host slots=N" (N processes, one per GPU); comments and blank lines allowed
    worker-0 slots=4
    worker-1 slots=4   # a trailing comment

Filters are DeepSpeed's: ``--include "worker-0@worker-1:0,2"`` keeps every slot of worker-0 and slots 0 and 2 of
worker-1; ``--exclude`` removes what it names; ``--num_nodes K`` keeps the first K hosts. Every reader here is
strict: a line, filter or variable that cannot be read is refused naming it, never skipped.

Variables forwarded to the hosts (an ssh session starts with the remote login environment, not this one): those of
this process whose names start with one of DeepSpeed's prefixes (``NCCL``, ``PYTHON``, ``MLFLOW``, ``MV2``,
``UCX``) or ``SHARDKIT_``, then the ``KEY=VALUE`` lines of ``~/.deepspeed_env`` and ``./.deepspeed_env`` (file name
from ``DS_ENV_FILE`` when set, as DeepSpeed's runner), and the directory the job runs in is put first on
``PYTHONPATH``, as DeepSpeed does, so that the script's own modules import on every host.

A value of an env file may name the remote host's variables, ``$NAME`` or ``${NAME}``, expanded there as DeepSpeed's
runner lets the remote shell expand them (``LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH``); ``\\$`` is a literal
``$``. Nothing else of the value reaches a shell: any other ``$`` or a backquote (command substitution, which
DeepSpeed's runner would run) is refused naming the line. Variables of this process are passed as they are.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ENV_FILE_NAME_VAR", "FORWARDED_PREFIXES", "HostfileError", "RemoteValue", "forwarded_environment",
           "parse_filter", "parse_hostfile", "read_env_file", "read_hostfile", "remote_assignment", "select_hosts"]

# What DeepSpeed's runner forwards (its EXPORT_ENVS plus the CUDA accelerator's NCCL), and shardkit's own settings
# (collective timeout, config file).
FORWARDED_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "SHARDKIT_")
ENV_FILE_NAME_VAR = "DS_ENV_FILE"
DEFAULT_ENV_FILE_NAME = ".deepspeed_env"
# A hostfile or env file is a few lines; a bigger one is the wrong file.
_MAX_FILE_BYTES = 1 << 20
# Slots are listed one by one; a typo's billions would hang the launcher building the list.
_MAX_SLOTS = 1 << 16
_LINE = re.compile(r"(\S+)\s+slots=(\S+)\s*(?:#.*)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# In an env file's value: an escaped "$", a reference to a remote variable, or a "$"/backquote that is neither.
_VALUE_PART = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|[$`]")
# What ssh takes as a destination: [user@]name, an IPv4 or a bracketless IPv6 address; never a leading "-" (an option).
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_:][A-Za-z0-9_.:%-]*")


class HostfileError(ValueError):
    """A hostfile, resource filter or env file that cannot be read; the message names the file, line or entry."""


class RemoteValue(str):
    """An env file's value: its ``$NAME`` / ``${NAME}`` are the remote host's variables (see the module docstring).
    :func:`remote_assignment` writes it for the remote shell; a plain ``str`` value is passed as it is."""


def _value_parts(value: str) -> list[tuple[bool, str]]:
    """``(is_reference, text)`` pieces of an env file's value; ValueError on a ``$`` or backquote that is not one."""
    parts: list[tuple[bool, str]] = []
    literal, position = "", 0
    for match in _VALUE_PART.finditer(value):
        literal += value[position:match.start()]
        position = match.end()
        name = match.group(1) or match.group(2)
        if match.group(0) == "\\$":
            literal += "$"
        elif name:
            parts += [(False, literal), (True, name)]
            literal = ""
        else:
            raise ValueError(f"{match.group(0)!r} at character {match.start() + 1} is neither $NAME nor ${{NAME}}: "
                             "no command runs from an env file; write \\$ for a literal $")
    return [part for part in [*parts, (False, literal + value[position:])] if part[1]]


def remote_assignment(key: str, value: str) -> str:
    """``KEY=VALUE`` as one word of the remote shell line: quoted whole, but for a :class:`RemoteValue`'s
    ``$NAME`` references, which the remote shell expands (inside double quotes: one word, never split)."""
    if not isinstance(value, RemoteValue):
        return shlex.quote(f"{key}={value}")
    words = [shlex.quote(f"{key}=")]
    for is_reference, text in _value_parts(value):
        words.append(f'"${{{text}}}"' if is_reference else shlex.quote(text))
    return "".join(words)


def _read_text(path: Path, what: str) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as err:
        raise HostfileError(f"{what} {str(path)!r}: {err.strerror or err}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise HostfileError(f"{what} {str(path)!r} is over {_MAX_FILE_BYTES} bytes; it is not a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise HostfileError(f"{what} {str(path)!r} is not UTF-8 text") from None


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``host -> slots`` in file order from DeepSpeed's hostfile format.

    Raises:
        HostfileError: a line that is not ``host slots=N`` (N >= 1), a host named twice, or no host at all.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise HostfileError(f"{source} line {number}: {line[:200]!r} is not 'HOST slots=N'")
        host, slots = match.group(1), match.group(2)
        if not _HOST.fullmatch(host):
            raise HostfileError(f"{source} line {number}: {host[:100]!r} is not a host name ([user@]name or address)")
        if not slots.isdigit() or not 1 <= int(slots) <= _MAX_SLOTS:
            raise HostfileError(f"{source} line {number}: slots={slots[:50]} must be a whole number in [1, "
                                f"{_MAX_SLOTS}] (processes on that host)")
        if host in hosts:
            raise HostfileError(f"{source} line {number}: host {host!r} is already named; one line per host")
        hosts[host] = int(slots)
    if not hosts:
        raise HostfileError(f"{source} names no host; write one 'HOST slots=N' line per machine")
    return hosts


def read_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """:func:`parse_hostfile` of the file at ``path``."""
    return parse_hostfile(_read_text(Path(path), "hostfile"), f"hostfile {str(path)!r}")


def parse_filter(text: str, flag: str) -> dict[str, list[int] | None]:
    """DeepSpeed's ``NAME[:SLOT[,SLOT...]][@NAME...]``: ``host -> slots`` (None: every slot of that host)."""
    result: dict[str, list[int] | None] = {}
    for item in text.split("@"):
        name, _, slots = item.strip().partition(":")
        if not name:
            raise HostfileError(f"{flag} {text!r}: an empty host name; write 'HOST[:SLOT,...]@HOST...'")
        if ":" in item and not slots:
            raise HostfileError(f"{flag} {text!r}: {item!r} has no slot after ':'")
        if not slots:
            result[name] = None
            continue
        numbers = []
        for slot in slots.split(","):
            if not slot.strip().isdigit():
                raise HostfileError(f"{flag} {text!r}: slot {slot!r} of {name!r} is not a whole number")
            numbers.append(int(slot))
        if name in result and result[name] is None:
            continue  # the whole host is named elsewhere in the filter
        result[name] = sorted(set((result.get(name) or []) + numbers))
    return result


def select_hosts(pool: Mapping[str, int], include: str | None = None, exclude: str | None = None,
                 num_nodes: int | None = None, slots_per_host: int | None = None) -> dict[str, list[int]]:
    """The hosts and slots a job runs on, in hostfile order (which fixes the machine ranks).

    Args:
        pool: the hostfile's ``host -> slots``.
        include, exclude: DeepSpeed's filters; one at most.
        num_nodes: keep the first K hosts (not with a filter, as DeepSpeed's runner).
        slots_per_host: keep slots ``[0, N)`` of every host (DeepSpeed's ``--num_gpus``).

    Raises:
        HostfileError: both filters, a filter with ``num_nodes``, a host or slot the hostfile does not have, or
            nothing left.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together; name what to keep or what to drop")
    if num_nodes is not None and (include or exclude):
        raise HostfileError("--num_nodes cannot be used with --include/--exclude (as DeepSpeed's runner); "
                            "name the hosts in the filter instead")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    if text:
        wanted = parse_filter(text, flag)
        for host, slots in wanted.items():
            if host not in active:
                raise HostfileError(f"{flag}: host {host!r} is not in the hostfile (it has {list(pool)})")
            missing = sorted(set(slots or ()) - set(active[host]))
            if missing:
                raise HostfileError(f"{flag}: host {host!r} has slots 0-{pool[host] - 1}; {missing} do not exist")
        if include:
            active = {host: (wanted[host] or active[host]) for host in active if host in wanted}
        else:
            for host, slots in wanted.items():
                active[host] = [] if slots is None else [s for s in active[host] if s not in slots]
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(active):
            raise HostfileError(f"--num_nodes({num_nodes}) must be in [1, {len(active)}], the hosts in the hostfile")
        active = dict(list(active.items())[:num_nodes])
    if slots_per_host is not None:
        short = [host for host, slots in active.items() if len(slots) < slots_per_host]
        if slots_per_host < 1 or short:
            raise HostfileError(f"--num-processes({slots_per_host}) per host: must be >= 1 and at most each host's "
                                f"slots; {short or list(active)} have fewer")
        active = {host: slots[:slots_per_host] for host, slots in active.items()}
    active = {host: slots for host, slots in active.items() if slots}
    if not active:
        raise HostfileError(f"{flag} {text!r} leaves no host to run on")
    return active


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped; the value is the rest of the line without the
    spaces around it, a :class:`RemoteValue` when it names remote variables).

    Raises:
        HostfileError: naming the line: not ``KEY=VALUE``, or a ``$``/backquote that is not a variable reference.
    """
    source = str(path)
    values: dict[str, str] = {}
    for number, raw in enumerate(_read_text(Path(path), "env file").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()  # "KEY = value" as DeepSpeed's runner reads it: no leading space
        if not sep or not _NAME.fullmatch(key):
            raise HostfileError(f"env file {source!r} line {number}: {line[:200]!r} is not KEY=VALUE with KEY a "
                                "variable name")
        try:
            _value_parts(value)
        except ValueError as err:
            raise HostfileError(f"env file {source!r} line {number}: {key}'s value: {err}") from None
        values[key] = RemoteValue(value) if "$" in value else value
    return values


def forwarded_environment(environ: Mapping[str, str], cwd: str | os.PathLike,
                          home: str | os.PathLike | None = None) -> dict[str, str]:
    """The variables every host's job gets: see the module docstring. Later sources win over earlier ones."""
    values = {key: value for key, value in environ.items() if key.startswith(FORWARDED_PREFIXES)}
    name = environ.get(ENV_FILE_NAME_VAR) or DEFAULT_ENV_FILE_NAME
    folders = [Path(home if home is not None else Path.home()), Path(cwd)]
    seen = set()
    for folder in folders:
        path = (folder / name).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        values.update(read_env_file(path))
    here = str(Path(cwd).resolve())
    rest = values.get("PYTHONPATH")
    if isinstance(rest, RemoteValue):  # keep its remote references; this directory's own "$" stays literal
        values["PYTHONPATH"] = RemoteValue(here.replace("$", "\\$") + ":" + rest)
    else:
        values["PYTHONPATH"] = here + (":" + rest if rest else "")
    return values
