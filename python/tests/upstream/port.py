"""Writes CPU ports of PyTorch's symmetric-memory tests from the upstream files you downloaded.

PyTorch's code is not in this repository, not even ported: this script holds only the rules of
the port (regular-expression substitutions, a table of the tests that cannot apply on a CPU with
the reason, and a few structural edits), applies them to the files you give it and writes the
ports where you say, outside the repository's tracked tree:

    python port.py [-o DIR] test_symmetric_memory.py test_nvshmem.py test_nccl.py symmetric_memory.md
    python run.py --port-dir DIR

DIR defaults to ``$SYMMEM_UPSTREAM_PORT``, else ``ported/`` beside this file (git-ignored). A
directory inside the repository that git does not ignore is refused. README.md beside this file
lists the exact upstream versions and their URLs.

The port moves each test to the CPU the way a user moves GPU code: device ``cpu``, process group
backend ``gloo``, symmetric-memory backend ``CPU`` (symmem's), ``symmem.symm.install()`` once at
import, the test bases and gates of ``torch.testing._internal`` from ``harness.py``. A rule that
no longer finds what it changes (the upstream file moved on) stops the port with an error naming
the rule, the test or the anchor, instead of writing a port that silently differs.
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import port_docs  # noqa: E402 - the directory above is where it lives
from port_rules import EXTRA_TESTS, SKIPS  # noqa: E402

#: Where the ports go unless told otherwise (git-ignored).
DEFAULT_OUT = os.path.join(HERE, "ported")

#: What ``harness.py`` provides in place of ``torch.testing._internal``'s names.
HARNESS_NAMES = frozenset(
    """TestCase MultiProcContinuousTest MultiProcessTestCase parametrize subtest
    instantiate_parametrized_tests skip_if_lt_x_gpu skip_but_pass_in_sandcastle_if
    requires_cuda_p2p_access PLATFORM_SUPPORTS_SYMM_MEM TEST_WITH_ROCM IS_WINDOWS MI350_ARCH
    SM89OrLater SM90OrLater SM100OrLater e4m3_type getRocmVersion isRocmArchAnyOf
    skip_if_rocm_multiprocess skip_if_rocm_arch_multiprocess skip_if_rocm_ver_lessthan_multiprocess
    skipIfRocm requires_nccl_version lazy_skip_if requires_multicast_support requires_nccl
    requires_cuda_python_bindings get_cycles_per_ms setup_torchcomms_pg""".split()
)

#: Names of the harness that the port's own rules introduce, imported when the port uses them.
PORT_HELPERS = ("cpu_na", "optional_op", "gloo_all_to_all")


class PortError(Exception):
    """The port cannot be written as its rules say: an unknown input, a rule that matches
    nothing, a test the skip table names that is not there, an output inside the repository."""


@dataclasses.dataclass(frozen=True)
class Sub:
    """A regular-expression substitution (``re.M``) that must match at least once."""

    name: str
    pattern: str
    replacement: str

    def apply(self, text, where):
        new, count = re.subn(self.pattern, self.replacement, text, flags=re.M)
        if count == 0:
            raise PortError(f"{where}: rule {self.name!r} matched nothing (/{self.pattern}/)")
        return new, count


# The substitutions, by what they move to the CPU.
DEVICE_INDEXED = Sub("torch.device(device_type, rank) -> torch.device(device_type)",
                     r"torch\.device\(device_type, self\.rank\)", "torch.device(device_type)")
CUDA_DEVICE_CALL = Sub('torch.device("cuda", i) -> torch.device("cpu")',
                       r'torch\.device\("cuda", [^()]+\)', 'torch.device("cpu")')
CUDA_STRING = Sub('"cuda", "cuda:N", f"cuda:{...}" -> "cpu"',
                  r'(?:\bf)?"cuda(?::(?:\d+|\{\w+\}))?"', '"cpu"')
CUDA_MODULE_CALLS = Sub("torch.cuda.set_device/synchronize -> torch.cpu's",
                        r"\btorch\.cuda\.(set_device|synchronize)\(", r"torch.cpu.\1(")
NCCL_PG = Sub('process group backend "nccl" -> "gloo"', r'\bbackend="nccl"', 'backend="gloo"')
NCCL_DEVICE_ID = Sub("init_process_group: no device_id (NCCL's eager communicator init)",
                     r"^[ \t]*device_id=device,\n", "")
SYMM_BACKEND = Sub('symm_mem.set_backend("NCCL"/"NVSHMEM") -> symmem\'s "CPU"',
                   r'\b(symm_mem\.set_backend\()"(?:NCCL|NVSHMEM)"\)', r'\1"CPU")')
MULTICAST_QUERY = Sub("has_multicast_support on the CPU device",
                      r"DeviceType\.CUDA, self\.device\.index", "DeviceType.CPU, 0")
DEVICE_COUNT = Sub("world_size: the job's ranks (upstream: one rank per GPU)",
                   r"\breturn device_module\.device_count\(\)", "return super().world_size")
REQUIRES_CUDA = Sub("@requires_cuda dropped (the test runs on the CPU)",
                    r"^[ \t]*@requires_cuda\n", "")
NVSHMEM_GATE = Sub("requires_nvshmem/requires_nvls do not skip: symmem's CPU backend stands in",
                   r"\bnot (?:symm_mem\.is_nvshmem_available|has_nvls_support)\(\),$",
                   "False,  # CPU port: symmem's CPU backend stands in")
GLOO_ALL_TO_ALL = Sub("dist.all_to_all -> gloo_all_to_all (gloo: equal sizes only)",
                      r"\bdist\.all_to_all\(", "gloo_all_to_all(")


@dataclasses.dataclass(frozen=True)
class PythonSpec:
    """How one upstream test file becomes its CPU port."""

    output: str
    subs: tuple
    #: Keep only this class (and the imports it uses) of the upstream file.
    keep_class: str = None
    #: Operators named in @parametrize lists go through harness.optional_op.
    optional_ops: bool = False


SPECS = {
    "test_symmetric_memory.py": PythonSpec(
        "test_symmetric_memory.py",
        (DEVICE_INDEXED, CUDA_DEVICE_CALL, CUDA_STRING, CUDA_MODULE_CALLS, NCCL_PG, DEVICE_COUNT,
         REQUIRES_CUDA),
    ),
    "test_nvshmem.py": PythonSpec(
        "test_nvshmem.py",
        (DEVICE_INDEXED, CUDA_STRING, CUDA_MODULE_CALLS, SYMM_BACKEND, NVSHMEM_GATE,
         GLOO_ALL_TO_ALL),
        optional_ops=True,
    ),
    "test_nccl.py": PythonSpec(
        "test_nccl.py",
        (CUDA_DEVICE_CALL, CUDA_MODULE_CALLS, NCCL_PG, NCCL_DEVICE_ID, SYMM_BACKEND,
         MULTICAST_QUERY),
        keep_class="NCCLSymmetricMemoryTest",
    ),
}

#: The docs page's port (port_docs.py) and the upstream versions the rules were checked on.
DOCS_INPUT, DOCS_OUTPUT = "symmetric_memory.md", "test_docs_symmetric_memory.py"
CHECKED_SHA256 = {
    "test_symmetric_memory.py": "c63a6fd50675ba403e541787447fac8ec24200c8f18cbcd6c3dc928720057e8a",
    "test_nvshmem.py": "e6253a4b1fa77f1b27751dd5d5420138b5c8da71a06edf7070c13e78f49bd1c4",
    "test_nccl.py": "2824b408a1c9e8e6d00170a2b24a002dc5e053bc269f0a1766e798c34ab19d56",
    "symmetric_memory.md": "610405b8fa7c9fe816354b127af0141a724be92aaf5100b41d5d16a81ee348ef",
}


def port_python(source, spec, *, skips, extras=None, where="input"):
    """The CPU port of the upstream test file ``source`` per ``spec``; returns (text, report)
    where report lists what each rule changed."""
    report = []
    text = source
    if spec.keep_class:
        text = keep_only_class(text, spec.keep_class, where)
        report.append(f"kept class {spec.keep_class} and the imports it uses")
    for sub in spec.subs:
        text, count = sub.apply(text, where)
        report.append(f"{sub.name}: {count}")
    text, n = replace_device_type_instantiation(text)
    if n:
        report.append(f"instantiate_device_type_tests -> @instantiate_parametrized_tests: {n}")
    text = drop_main_block(text)
    if spec.optional_ops:
        text, count = optional_ops_in_parametrize(text)
        if count == 0:
            raise PortError(f"{where}: no torch.ops.symm_mem operator in a @parametrize list")
        report.append(f"operators in @parametrize lists -> optional_op: {count}")
    text = add_skips(text, skips, where)
    report.append(f"skipped as not applicable on CPU: {len(skips)}")
    for cls, extra in (extras or {}).items():
        text = append_to_class(text, cls, extra, where)
        report.append(f"this port's own tests appended to {cls}")
    text, dropped = use_harness_imports(text, where)
    still_used = sorted(dropped & loaded_names(text))
    if still_used:
        raise PortError(f"{where}: still uses {', '.join(still_used)}, which harness.py does not provide")
    check_compiles(text, where)
    return text, report


def keep_only_class(text, name, where):
    """The class ``name`` of ``text`` with its decorators, after the module's imports that it
    uses (aliases it does not use are dropped)."""
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise PortError(f"{where}: no class {name}")
    used = loaded_names(ast.get_source_segment(text, cls)) | {
        n.id for d in cls.decorator_list for n in ast.walk(d) if isinstance(n, ast.Name)
    } | {n.id for b in cls.bases for n in ast.walk(b) if isinstance(n, ast.Name)}
    imports = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            aliases = [a for a in node.names if bound_name(a) in used]
            if aliases:
                node.names = aliases
                imports.append(ast.unparse(node))
    lines = text.splitlines(keepends=True)
    start = min([d.lineno for d in cls.decorator_list] + [cls.lineno])
    return "\n".join(imports) + "\n\n\n" + "".join(lines[start - 1 : cls.end_lineno])


def bound_name(alias):
    return alias.asname or alias.name.split(".")[0]


def loaded_names(text):
    return {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}


def replace_device_type_instantiation(text):
    """``instantiate_device_type_tests(Cls, globals(), only_for="cuda")`` makes CUDA variants of
    Cls's tests; on the CPU the class is instantiated as a parametrized one instead."""
    tree = ast.parse(text)
    edits = []
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "instantiate_device_type_tests":
            cls_name = call.args[0].id
            cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
            edits.append(("drop", node.lineno, node.end_lineno))
            start = min([d.lineno for d in cls.decorator_list] + [cls.lineno])
            edits.append(("insert", start, "@instantiate_parametrized_tests\n"))
    return apply_line_edits(text, edits), len(edits) // 2


def drop_main_block(text):
    """Upstream's ``if __name__ == "__main__": run_tests()``: run.py runs the ports."""
    tree = ast.parse(text)
    edits = [
        ("drop", n.lineno, n.end_lineno)
        for n in tree.body
        if isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)
    ]
    return apply_line_edits(text, edits)


def optional_ops_in_parametrize(text):
    """``torch.ops.symm_mem.X`` in a @parametrize list -> ``optional_op("X")``, so that a case
    naming an operator the installed torch lacks is skipped rather than failing the import."""
    tree = ast.parse(text)
    spans = [
        (d.lineno, d.end_lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        for d in n.decorator_list
        if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "parametrize"
    ]
    lines = text.splitlines(keepends=True)
    total = 0
    for first, last in spans:
        for i in range(first - 1, last):
            lines[i], count = re.subn(r"\btorch\.ops\.symm_mem\.(\w+)", r'optional_op("\1")', lines[i])
            total += count
    return "".join(lines), total


def add_skips(text, skips, where):
    """``@cpu_na(reason)`` on each class or ``Class.test`` that ``skips`` names."""
    tree = ast.parse(text)
    targets = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            targets[node.name] = node
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    targets[f"{node.name}.{item.name}"] = item
    missing = sorted(set(skips) - set(targets))
    if missing:
        raise PortError(f"{where}: the skip table names what is not there: {', '.join(missing)}")
    lines = text.splitlines(keepends=True)
    edits = []
    for key, reason in skips.items():
        node = targets[key]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        indent = re.match(r"[ \t]*", lines[start - 1]).group()
        edits.append(("insert", start, f"{indent}@cpu_na({json.dumps(reason)})\n"))
    return apply_line_edits(text, edits)


def append_to_class(text, name, extra, where):
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise PortError(f"{where}: no class {name} to append this port's own tests to")
    return apply_line_edits(text, [("insert", cls.end_lineno + 1, "\n" + extra)])


def use_harness_imports(text, where):
    """Replaces the imports from ``torch.testing._internal.common_*`` with one from harness.py
    (plus the port's own helpers the text uses) and installs symmem after the last import.
    Returns the text and the set of upstream names the harness does not provide."""
    tree = ast.parse(text)
    internal = [
        n for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch.testing._internal.common_")
    ]
    if not internal:
        raise PortError(f"{where}: no import from torch.testing._internal.common_* to replace")
    names = {bound_name(a) for n in internal for a in n.names}
    used = loaded_names(text)
    wanted = {n for n in names if n in HARNESS_NAMES} | {h for h in PORT_HELPERS if h in used}
    imports_end = 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports_end = node.end_lineno
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break
    block = (
        "\nimport symmem.symm\n\n"
        "# CPU port: harness.py replaces torch.testing._internal's test bases and gates.\n"
        "from harness import (\n"
        + "".join(f"    {n},\n" for n in sorted(wanted, key=str.lower))
        + ")\n\n"
        "# CPU port: torch.distributed._symmetric_memory uses symmem for CPU tensors.\n"
        "symmem.symm.install()\n"
    )
    edits = [("drop", n.lineno, n.end_lineno) for n in internal]
    edits.append(("insert", imports_end + 1, block))
    return apply_line_edits(text, edits), names - HARNESS_NAMES


def apply_line_edits(text, edits):
    """Applies ("drop", first, last) and ("insert", before_line, text) edits, 1-based lines of
    the original text, from the bottom up so that each keeps its meaning."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # Bottom up; at one line, the drop first so that an insert there lands where it was.
    for edit in sorted(edits, key=lambda e: (e[1], e[0] == "drop"), reverse=True):
        if edit[0] == "drop":
            del lines[edit[1] - 1 : edit[2]]
        else:
            lines.insert(edit[1] - 1, edit[2])
    return "".join(lines)


def check_compiles(text, where):
    try:
        compile(text, where, "exec")
    except SyntaxError as e:
        raise PortError(f"{where}: the port does not compile: {e}") from None


def header(name, digest, report):
    lines = [
        f"# CPU port of PyTorch's {name} (sha256 {digest[:16]}), written by symmem's",
        "# python/tests/upstream/port.py. PyTorch's code, under PyTorch's BSD-3-Clause license:",
        "# not for committing to symmem. Run it with python/tests/upstream/run.py.",
        "#",
        "# What the port changed:",
        *(f"#   {r}" for r in report),
        "",
    ]
    return "\n".join(lines) + "\n"


def port_file(path):
    """(output name, text, report, note) of the CPU port of the upstream file at ``path``."""
    name = os.path.basename(path)
    if name not in SPECS and name != DOCS_INPUT:
        known = ", ".join([*SPECS, DOCS_INPUT])
        raise PortError(f"{path}: not an upstream file this port knows (known: {known})")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    digest = hashlib.sha256(source.encode()).hexdigest()
    note = None
    if digest != CHECKED_SHA256[name]:
        note = (f"{name}: sha256 {digest[:16]}, not the version these rules were checked on "
                f"({CHECKED_SHA256[name][:16]}); README.md lists it")
    if name == DOCS_INPUT:
        output = DOCS_OUTPUT
        text, report = port_docs.port(source, where=name, skips=SKIPS[name], error=PortError)
        check_compiles(text, name)
    else:
        spec = SPECS[name]
        output = spec.output
        text, report = port_python(source, spec, skips=SKIPS[name], extras=EXTRA_TESTS.get(name), where=name)
    return output, header(name, digest, report) + text, report, note


def check_outside_tracked_tree(out_dir, probe):
    """Refuses an output directory inside a git work tree unless git ignores it there."""
    parent = out_dir
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    try:
        top = subprocess.run(["git", "-C", parent, "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return
    if top.returncode != 0:
        return  # not in a git work tree
    inside = os.path.join(out_dir, probe)
    ignored = subprocess.run(["git", "-C", top.stdout.strip(), "check-ignore", "-q", "--", inside],
                             capture_output=True, timeout=30)
    if ignored.returncode != 0:
        raise PortError(
            f"{out_dir} is inside the git work tree {top.stdout.strip()} and not ignored there: "
            "the ports are PyTorch's code and must not be committed; choose a directory outside "
            "the repository, or the default (ported/ beside port.py, git-ignored)"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="the upstream files as downloaded")
    p.add_argument("-o", "--out", help="output directory (default: $SYMMEM_UPSTREAM_PORT, else ported/ here)")
    args = p.parse_args(argv)
    out_dir = os.path.abspath(args.out or os.environ.get("SYMMEM_UPSTREAM_PORT") or DEFAULT_OUT)
    try:
        check_outside_tracked_tree(out_dir, DOCS_OUTPUT)
        ported = [port_file(path) for path in args.files]
    except (PortError, OSError) as e:
        print(f"port.py: {e}", file=sys.stderr)
        return 2
    os.makedirs(out_dir, exist_ok=True)
    for output, text, report, note in ported:
        target = os.path.join(out_dir, output)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"{target}: {'; '.join(report)}")
        if note:
            print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
