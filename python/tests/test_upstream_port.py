"""port.py (upstream/) on small upstream-like files written here: the rules move a test file to
the CPU, say which rule no longer applies, keep only what they are told to, turn a docs page's
examples into tests, and never write into the repository's tracked tree. No PyTorch file is
needed, nor torch itself (except for the harness's own part, at the end)."""

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(UPSTREAM, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, UPSTREAM)
port = _load("port")

UPSTREAM_LIKE = textwrap.dedent('''\
    # Owner(s): ["module: c10d"]

    import os

    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import (
        MultiProcContinuousTest,
        skip_if_lt_x_gpu,
    )
    from torch.testing._internal.common_utils import (
        instantiate_parametrized_tests,
        parametrize,
        requires_cuda,
        run_tests,
    )

    device_type = "cuda"


    @instantiate_parametrized_tests
    class FooTest(MultiProcContinuousTest):
        @property
        def device(self):
            dev = torch.device(device_type, self.rank)
            return dev

        @requires_cuda
        @skip_if_lt_x_gpu(2)
        def test_alloc(self) -> None:
            torch.cuda.set_device(self.device)
            t = torch.empty(4, device="cuda:0")
            dist.init_process_group(backend="nccl")

        @skip_if_lt_x_gpu(2)
        @parametrize("n", [1, 2])
        def test_graph(self, n) -> None:
            g = torch.cuda.CUDAGraph()


    class BarTest(MultiProcContinuousTest):
        def test_env(self) -> None:
            os.environ.get("X")


    if __name__ == "__main__":
        run_tests()
''')

SPEC = port.PythonSpec("test_foo.py", (port.DEVICE_INDEXED, port.CUDA_STRING, port.CUDA_MODULE_CALLS,
                                       port.NCCL_PG, port.REQUIRES_CUDA))


def _decorators(text, cls, name):
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    if name is not None:
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [ast.unparse(d) for d in node.decorator_list]


def test_a_test_file_moves_to_the_cpu_by_its_rules():
    text, report = port.port_python(UPSTREAM_LIKE, SPEC, skips={"FooTest.test_graph": "CUDA graphs"})

    compile(text, "port", "exec")
    assert "from torch.testing._internal" not in text
    assert 'device_type = "cpu"' in text and '"cuda' not in text
    assert "torch.device(device_type)" in text and "torch.cpu.set_device(self.device)" in text
    assert 'backend="gloo"' in text
    assert "run_tests" not in text and "requires_cuda" not in text
    # The harness replaces the test bases; symmem is installed once, after the last import.
    tree = ast.parse(text)
    harness_import = next(n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "harness")
    assert {a.name for a in harness_import.names} == {
        "MultiProcContinuousTest", "skip_if_lt_x_gpu", "instantiate_parametrized_tests", "parametrize", "cpu_na",
    }
    install = next(i for i, n in enumerate(tree.body) if "symmem.symm.install()" in ast.unparse(n))
    assert all(not isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body[install:])
    # The skip table's entry is the test's outermost decorator; the others are untouched.
    assert _decorators(text, "FooTest", "test_graph") == [
        "cpu_na('CUDA graphs')", "skip_if_lt_x_gpu(2)", "parametrize('n', [1, 2])",
    ]
    assert _decorators(text, "FooTest", "test_alloc") == ["skip_if_lt_x_gpu(2)"]
    assert "skipped as not applicable on CPU: 1" in report


def test_a_rule_that_no_longer_applies_says_which():
    spec = port.PythonSpec("test_foo.py", (port.SYMM_BACKEND,))
    with pytest.raises(port.PortError, match=r"test_foo.py: rule 'symm_mem.set_backend"):
        port.port_python(UPSTREAM_LIKE, spec, skips={}, where="test_foo.py")


def test_a_skip_of_a_test_that_is_not_there_is_an_error():
    with pytest.raises(port.PortError, match=r"names what is not there: FooTest.test_gone"):
        port.port_python(UPSTREAM_LIKE, SPEC, skips={"FooTest.test_gone": "CUDA graphs"})


def test_a_kept_class_comes_with_only_the_imports_it_uses():
    spec = port.PythonSpec("test_foo.py", (port.CUDA_STRING, port.REQUIRES_CUDA), keep_class="FooTest")
    text, _ = port.port_python(UPSTREAM_LIKE, spec, skips={})

    tree = ast.parse(text)
    assert [n.name for n in tree.body if isinstance(n, ast.ClassDef)] == ["FooTest"]
    imported = {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert "os" not in imported  # only BarTest used it
    assert {"torch", "dist"} <= imported


def test_device_type_tests_become_parametrized_ones():
    source = UPSTREAM_LIKE.replace(
        'if __name__ == "__main__":',
        'instantiate_device_type_tests(BarTest, globals(), only_for="cuda")\n\nif __name__ == "__main__":',
    ).replace("    run_tests,\n", "    run_tests,\n    instantiate_device_type_tests,\n")
    text, report = port.port_python(source, SPEC, skips={"BarTest": "CUDA streams"})

    assert "instantiate_device_type_tests" not in text
    assert _decorators(text, "BarTest", None) == ["cpu_na('CUDA streams')", "instantiate_parametrized_tests"]
    assert any("instantiate_device_type_tests" in r for r in report)


def test_a_name_the_harness_does_not_provide_stops_the_port():
    source = UPSTREAM_LIKE.replace("g = torch.cuda.CUDAGraph()", "g = run_tests")
    with pytest.raises(port.PortError, match="still uses run_tests"):
        port.port_python(source, SPEC, skips={})


PAGE = textwrap.dedent('''\
    # A page

    ## Hello World

    ```python
    import torch.distributed._symmetric_memory as sm

    buf = sm.empty(8, device=torch.device("cuda", rank))
    handle = sm.rendezvous(buf, group)
    ```

    Prose, then the same example goes on:

    ```python
    torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
    ```

    ## Two Ways

    ```python
    x = symm_mem.empty(4, device=device)
    symm_mem.rendezvous(x, group=group)
    ```

    ```python
    symm_mem.set_backend("NCCL")
    y = symm_mem.empty(4, device=f"cuda:{rank}")
    ```

    ```bash
    NCCL_DEBUG=INFO python train.py
    ```

    ```
    AllReduce [Symmetric]: 2097152 Bytes -> Kernel
    ```

    ## Reference

    ```{eval-rst}
    .. py:function:: tile_reduce(in_tile: Tensor) -> None

        Example::

            >>> # doctest: +SKIP
            >>> torch.ops.symm_mem.tile_reduce(in_tile, root=0, group_name)
    ```
''')


def _methods(text):
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef))
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_a_pages_examples_become_tests_named_after_their_sections():
    checks = (
        ("test_hello_world", r"sm\.rendezvous\(", ["buf.fill_(1)"]),
        ("test_hello_world", None, ["self.assertEqual(result, buf)"]),
    )
    text, report = port.port_docs.port(PAGE, where="page.md", skips={"test_two_ways_2": "NCCL"}, checks=checks)

    compile(text, "page", "exec")
    tests = _methods(text)
    assert sorted(tests) == [
        "test_hello_world", "test_reference_tile_reduce_example", "test_two_ways_1", "test_two_ways_2",
    ]
    hello = ast.unparse(tests["test_hello_world"])
    # The second block goes on with the first one's names: one test. The page's free names are
    # bound to the default group's, `group` to its name where it goes to a torch.ops call.
    assert "group = dist.group.WORLD.group_name" in hello
    assert 'torch.device("cuda"' not in hello and "torch.device('cpu')" in hello
    assert hello.index("handle = sm.rendezvous") < hello.index("buf.fill_(1)") < hello.index("result = torch.ops")
    assert hello.rstrip().endswith("self.assertEqual(result, buf)")
    one = ast.unparse(tests["test_two_ways_1"])
    assert "group = dist.group.WORLD\n" in one and "device = self.device" in one
    two = tests["test_two_ways_2"]
    assert [ast.unparse(d) for d in two.decorator_list] == ["cpu_na('NCCL')", "skip_if_lt_x_gpu(2)"]
    assert "symm_mem.set_backend('CPU')" in ast.unparse(two) and "'cpu'" in ast.unparse(two)
    ref = tests["test_reference_tile_reduce_example"]
    assert "doctest: +SKIP" in ast.unparse(ref.decorator_list[0])
    assert "examples as tests: 4" in report[0]


def test_a_page_rule_naming_an_example_that_is_not_there_is_an_error():
    with pytest.raises(ValueError, match="test_gone"):
        port.port_docs.port(PAGE, where="page.md", skips={"test_gone": "NCCL"}, checks=())


def test_an_example_that_runs_with_an_undefined_name_is_an_error():
    page = PAGE.replace('symm_mem.set_backend("NCCL")', "configure(symm_mem)")
    with pytest.raises(ValueError, match="test_two_ways_2 uses names the page leaves undefined: configure"):
        port.port_docs.port(page, where="page.md", skips={}, checks=())


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, os.path.join(UPSTREAM, "port.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_the_ports_are_never_written_into_the_tracked_tree(tmp_path):
    upstream = tmp_path / "test_nvshmem.py"
    upstream.write_text(UPSTREAM_LIKE)
    inside = os.path.join(UPSTREAM, "not-ignored")
    out = _cli("-o", inside, str(upstream))
    assert out.returncode == 2
    assert "not ignored there" in out.stderr and "must not be committed" in out.stderr
    assert not os.path.exists(inside)


def test_an_unknown_file_or_a_rule_that_fails_writes_nothing(tmp_path):
    unknown = tmp_path / "test_other.py"
    unknown.write_text(UPSTREAM_LIKE)
    out = _cli("-o", str(tmp_path / "out"), str(unknown))
    assert out.returncode == 2 and "not an upstream file this port knows" in out.stderr
    # A file of a known name whose content the rules do not fit.
    known = tmp_path / "test_nvshmem.py"
    known.write_text(UPSTREAM_LIKE)
    out = _cli("-o", str(tmp_path / "out"), str(known))
    assert out.returncode == 2 and "test_nvshmem.py: rule" in out.stderr
    assert not (tmp_path / "out").exists()


def test_the_cli_writes_the_ports_where_told(tmp_path, monkeypatch):
    upstream = tmp_path / "test_foo.py"
    upstream.write_text(UPSTREAM_LIKE)
    monkeypatch.setitem(port.SPECS, "test_foo.py", SPEC)
    monkeypatch.setitem(port.SKIPS, "test_foo.py", {"FooTest.test_graph": "CUDA graphs"})
    monkeypatch.setitem(port.CHECKED_SHA256, "test_foo.py", "0" * 64)

    assert port.main(["-o", str(tmp_path / "out"), str(upstream)]) == 0
    written = (tmp_path / "out" / "test_foo.py").read_text()
    assert written.startswith("# CPU port of PyTorch's test_foo.py (sha256 ")
    assert "not for committing to symmem" in written
    assert '@cpu_na("CUDA graphs")' in written


def test_the_tables_name_only_files_the_port_knows():
    assert set(port.SKIPS) == set(port.SPECS) | {port.DOCS_INPUT}
    assert set(port.CHECKED_SHA256) == set(port.SKIPS)
    for table in port.SKIPS.values():
        assert all(reason.strip() for reason in table.values())


def test_the_harness_skips_only_the_cases_of_an_operator_torch_lacks():
    pytest.importorskip("torch")
    harness = _load("harness")

    class Cases(harness.TestCase):
        @harness.parametrize("op", [harness.optional_op("one_shot_all_reduce"), harness.optional_op("no_such_op")])
        def test_op(self, op):
            pass

    harness.instantiate_parametrized_tests(Cases)
    skips = {name: harness.static_skip(Cases(name)) for name in ("test_op_op0", "test_op_op1")}
    assert skips["test_op_op0"] is None
    assert "no torch.ops.symm_mem.no_such_op" in skips["test_op_op1"]
