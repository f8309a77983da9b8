"""The docs page's examples as tests: port.py's rules for ``docs/source/symmetric_memory.md``.

The page's examples are prose code blocks, not tests. Each fenced Python block (or unlabelled
block that parses as Python) becomes a test named after its section (``test_<section>``, numbered
``_1``, ``_2`` when a section has several); a block that only goes on with the names the block
before it made (``hdl.buffer_ptrs`` after ``hdl = ...``) joins that block's test instead. The
page leaves some names to the reader (``rank``, ``device``, ``group``...): each test binds the
ones it uses to the default process group's (``CONTEXT``). The examples move to the CPU by the
same substitutions as the test files. ``CHECKS`` adds this port's own lines so that an example
that runs also computed what the page says it computes. An example of the Op Reference's
``>>>`` blocks marked ``doctest: +SKIP`` on the page stays skipped, as the page has it.
"""

import ast
import builtins
import json
import re
import textwrap

#: Names the examples use without defining them, bound by each test that uses them.
CONTEXT = {
    "rank": "self.rank",
    "world_size": "self.world_size",
    "device": "self.device",
    "group_name": "dist.group.WORLD.group_name",
    "size": "1024",
    "ranks": "list(range(self.world_size))",
    "ep_ranks": "list(range(self.world_size))",
    # "group": the process group, or its name where the example passes it to a torch.ops call
    # (the operators' schemas take a group name).
    "group": None,
}

#: Imported at the top of the generated file.
MODULE_NAMES = {"torch", "dist", "symm_mem", "unittest"}

#: (test, anchor, lines): this port's lines after the statement whose first line matches the
#: regular expression ``anchor`` (at its indentation), or at the end of the test (anchor None).
#: ``result`` is the value of the example's last expression when a check names it.
CHECKS = (
    ("test_a_hello_world_example", r"symm_mem\.rendezvous\(", ["t.fill_(rank + 1)"]),
    ("test_a_hello_world_example", None, [
        "n = self.world_size",
        "self.assertEqual(result, torch.full((128,), n * (n + 1) / 2))",
        "self.assertEqual(hdl.world_size, n)",
    ]),
    ("test_write_your_own_kernel_1", None, [
        "self.assertEqual(len(hdl.buffer_ptrs), self.world_size)",
        "self.assertEqual(hdl.buffer_ptrs[rank], t.data_ptr())",
        "self.assertEqual(len(hdl.signal_pad_ptrs), self.world_size)",
        "self.assertEqual(hdl.multicast_ptr, 0)",
    ]),
    ("test_one_sided_get", r"src = symm_mem\.empty\(", [
        "src.copy_(torch.arange(1024) + 1024 * dist.get_rank())",
    ]),
    ("test_one_sided_get", r"symm_mem\.get\(dst,", [
        "self.assertEqual(dst, torch.arange(512, 1024, dtype=dst.dtype) + 1024)",
    ]),
    # The peer keeps its allocation until rank 0 has read it.
    ("test_one_sided_get", None, ["dist.barrier()"]),
    ("test_option_2_allocate_through_the_nccl_symmetric_memory_backend", r"symm_mem\.rendezvous\(x,",
     ["x.fill_(1)"]),
    ("test_option_2_allocate_through_the_nccl_symmetric_memory_backend", None,
     ["self.assertTrue(x.eq(self.world_size).all())"]),
    ("test_higher_precision_reduction", r"symm_mem\.rendezvous\(inp,", ["inp.fill_(0.5)"]),
    ("test_higher_precision_reduction", None, ["self.assertTrue(inp.eq(0.5 * self.world_size).all())"]),
)

#: The examples' own moves to the CPU (the test files' substitutions, and the page's init call,
#: which the harness has made already).
SUBS = (
    (r'torch\.device\("cuda", [^()]+\)', 'torch.device("cpu")'),
    (r'(?:\bf)?"cuda(?::(?:\d+|\{\w+\}))?"', '"cpu"'),
    (r'\bbackend="nccl"', 'backend="gloo"'),
    (r'\b(symm_mem\.set_backend\()"(?:NCCL|NVSHMEM)"\)', r'\1"CPU")'),
    (r"^([ \t]*)dist\.init_process_group\(\)[ \t]*$",
     r"\1pass  # CPU port: the harness has made the default process group (gloo)"),
)

PAGE_SKIP = "the page marks this example `doctest: +SKIP`"


class Example:
    """One test's worth of the page: its section and its code blocks (or a >>> example)."""

    def __init__(self, section, code, doctest=None):
        self.section, self.blocks, self.doctest = section, [code], doctest
        self.name = None


def port(page, *, where, skips, checks=CHECKS, error=ValueError):
    """The test file of the page's examples; returns (text, report). ``skips``: test name ->
    reason it cannot apply on a CPU; ``error``: the exception type for a rule that no longer
    applies."""
    examples = group_examples(parse(page))
    name_examples(examples)
    names = {e.name for e in examples}
    unknown = sorted(set(skips) - names) + sorted({c[0] for c in checks} - names)
    if unknown:
        raise error(f"{where}: the rules name examples the page does not have: {', '.join(unknown)}")
    tests = [render(e, skips.get(e.name), [c[1:] for c in checks if c[0] == e.name], where, error)
             for e in examples]
    text = PROLOGUE + "".join(tests)
    report = [
        f"examples as tests: {len(examples)} (skipped as not applicable on CPU: {len(skips)}, "
        f"marked doctest: +SKIP by the page: {sum(1 for e in examples if e.doctest)})",
        f"this port's checks: {len(checks)}",
    ]
    return text, report


PROLOGUE = '''import unittest

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

# CPU port: harness.py replaces torch.testing._internal's test base and gates.
from harness import cpu_na, MultiProcContinuousTest, skip_if_lt_x_gpu

# CPU port: torch.distributed._symmetric_memory uses symmem for CPU tensors.
symmem.symm.install()


class SymmetricMemoryDocsTest(MultiProcContinuousTest):
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")
'''


def parse(page):
    """[(section, kind, text)] of the page's code blocks: kind "python", or "doctest" for a >>>
    example of an eval-rst block (text: the example, with the function it documents)."""
    found, section, fence, body = [], None, None, []
    for line in page.splitlines():
        if fence is None:
            heading = re.match(r"#{1,6}\s+(.*)", line)
            if heading:
                section = heading.group(1).strip()
            opening = re.match(r"```(.*)", line)
            if opening:
                fence, body = opening.group(1).strip(), []
            continue
        if line.startswith("```"):
            found += blocks_of(section, fence, "\n".join(body))
            fence = None
        else:
            body.append(line)
    return found


def blocks_of(section, info, text):
    code = textwrap.dedent(text).strip("\n")
    if info == "python" or (info == "" and parses(code)):
        return [(section, "python", code)]
    if info == "{eval-rst}":
        return [(section, "doctest", ex) for ex in doctest_examples(text)]
    return []


def parses(code):
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def doctest_examples(text):
    """(function, lines, skipped) of each run of ``>>>`` lines, with the py:function before it."""
    out, function, run = [], None, []
    for line in text.splitlines() + [""]:
        directive = re.match(r"\s*\.\. py:function:: (\w+)", line)
        if directive:
            function = directive.group(1)
        prompt = re.match(r"\s*>>> ?(.*)", line)
        if prompt:
            run.append(prompt.group(1))
        elif run:
            out.append((function, run, any("doctest: +SKIP" in r for r in run)))
            run = []
    return out


def group_examples(blocks):
    """Examples from blocks: a Python block joins the one before it, in the same section, when
    it uses names that block made and nothing else of the page's context says what they are."""
    examples = []
    for section, kind, text in blocks:
        if kind == "doctest":
            example = Example(section, None, doctest=text)
            examples.append(example)
            continue
        prev = examples[-1] if examples else None
        if prev and not prev.doctest and prev.section == section:
            free = free_names(text) - set(CONTEXT) - MODULE_NAMES
            if free & bound_names("\n".join(prev.blocks)):
                prev.blocks.append(text)
                continue
        examples.append(Example(section, text))
    return examples


def name_examples(examples):
    counts = {}
    for e in examples:
        counts[e.section] = counts.get(e.section, 0) + 1
    seen = {}
    for e in examples:
        base = "test_" + slug(e.section)
        if e.doctest:
            e.name = f"{base}_{e.doctest[0]}_example"
        elif counts[e.section] > 1:
            seen[e.section] = seen.get(e.section, 0) + 1
            e.name = f"{base}_{seen[e.section]}"
        else:
            e.name = base


def slug(text):
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def render(example, skip, checks, where, error):
    """The test method of ``example``."""
    if example.doctest:
        function, lines, skipped = example.doctest
        body = [f"# >>> {line}" for line in lines] + ["pass"]
        decorators = [f"@unittest.skip({json.dumps(PAGE_SKIP)})"] if skipped else []
        if not skipped:
            raise error(f"{where}: {example.name}: a >>> example the page runs; this port has no rule for it")
        return method(example.name, decorators, body)
    code = "\n\n".join(example.blocks)
    for pattern, replacement in SUBS:
        code = re.sub(pattern, replacement, code, flags=re.M)
    if any("result" in line for _, lines in checks for line in lines):
        code = capture_last_expression(code, example.name, where, error)
    code = add_checks(code, checks, example.name, where, error)
    prelude = [f"{name} = {binding(name, code)}" for name in sorted(free_names(code) & set(CONTEXT))]
    # After the example's own imports: one of them may rebind a name the bindings read (dist).
    lines = code.splitlines()
    after = leading_imports_end(code)
    body = lines[:after] + prelude + lines[after:]
    decorators = ["@skip_if_lt_x_gpu(2)"]
    if skip:
        decorators.insert(0, f"@cpu_na({json.dumps(skip)})")
    else:
        unknown = free_names(code) - set(CONTEXT) - MODULE_NAMES - set(dir(builtins)) - {"self"}
        if unknown:
            raise error(f"{where}: {example.name} uses names the page leaves undefined: {', '.join(sorted(unknown))}")
    return method(example.name, decorators, body)


def leading_imports_end(code):
    """The line after the example's leading import statements (0 if it starts otherwise)."""
    end = 0
    for node in ast.parse(code).body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        end = node.end_lineno
    return end


def method(name, decorators, body):
    lines = ["", *decorators, f"def {name}(self) -> None:", *("    " + b if b else "" for b in body)]
    return "\n".join(("    " + line if line else "") for line in lines) + "\n"


def binding(name, code):
    if name != "group":
        return CONTEXT[name]
    passed_to_op = any(
        isinstance(n, ast.Call)
        and ast.unparse(n.func).startswith("torch.ops.")
        and any(isinstance(a, ast.Name) and a.id == "group" for a in [*n.args, *(k.value for k in n.keywords)])
        for n in ast.walk(ast.parse(code))
    )
    return "dist.group.WORLD.group_name" if passed_to_op else "dist.group.WORLD"


def capture_last_expression(code, name, where, error):
    tree = ast.parse(code)
    last = tree.body[-1]
    if not isinstance(last, ast.Expr):
        raise error(f"{where}: {name}: a check reads `result`, but the example ends in no expression")
    lines = code.splitlines()
    lines[last.lineno - 1] = lines[last.lineno - 1][: last.col_offset] + "result = " + lines[last.lineno - 1][last.col_offset :]
    return "\n".join(lines)


def add_checks(code, checks, name, where, error):
    lines = code.splitlines()
    statements = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.stmt)]
    inserts, tail = [], []
    for anchor, extra in checks:
        if anchor is None:
            tail += extra
            continue
        stmt = next((s for s in sorted(statements, key=lambda s: s.lineno)
                     if re.search(anchor, lines[s.lineno - 1])), None)
        if stmt is None:
            raise error(f"{where}: {name}: no statement matches the check's anchor /{anchor}/")
        indent = " " * stmt.col_offset
        inserts.append((stmt.end_lineno, [indent + e + "  # CPU port: check" for e in extra]))
    for after, extra in sorted(inserts, reverse=True):
        lines[after:after] = extra
    return "\n".join(lines + [t + "  # CPU port: check" for t in tail])


def free_names(code):
    """Names ``code``'s statements read before (or without) binding them, at its top level (a
    function's body is its own)."""
    return _Scope(code).free


def bound_names(code):
    return _Scope(code).bound


class _Scope(ast.NodeVisitor):
    def __init__(self, code):
        self.free, self.bound = set(), set()
        self.visit(ast.parse(code))

    def visit_Name(self, node):  # noqa: N802 - ast.NodeVisitor's naming
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound and node.id not in dir(builtins):
                self.free.add(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node):  # noqa: N802
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_FunctionDef(self, node):  # noqa: N802
        for d in node.decorator_list:
            self.visit(d)
        self.bound.add(node.name)

    def visit_Import(self, node):  # noqa: N802
        for alias in node.names:
            self.bound.add(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import  # noqa: N815
