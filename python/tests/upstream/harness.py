"""What PyTorch's multi-process test bases give a test, on the CPU, for the ported upstream suites.

The ported files (``port.py`` writes them into a directory of the user's choice, never into the
repository) import their test bases and decorators from here instead of
``torch.testing._internal`` (which needs ``expecttest`` and spawns one process per GPU):

- ``MultiProcContinuousTest``: ``self.rank``, ``self.world_size`` and a default process group
  (gloo) made by ``_init_pg`` before the test, as PyTorch's base does once per class;
- ``MultiProcessTestCase``: ``self.rank``, ``self.world_size`` and ``self.file_name`` (a
  ``FileStore`` path the ranks share); the test makes its own process group, as upstream;
- ``TestCase``: a single-process test, run by every rank on its own;
- ``parametrize`` / ``instantiate_parametrized_tests``, ``skip_if_lt_x_gpu`` (a "GPU" is a rank
  here) and the gates upstream's decorators express, as plain ``unittest`` skips.

Every test runs in a process of its own (``worker.py`` forks one per rank per test), so a test
that fails, hangs or exits takes down nothing else; a test's process group and symmem's world
are new for each test, as under upstream's ``MultiProcessTestCase``.
"""

import functools
import itertools
import os
import unittest
from datetime import timedelta

import torch

#: What every ported file runs on.
device_type = "cpu"

#: Prefix of the reason of every skip that marks a test as not applicable on the CPU.
NOT_APPLICABLE = "not applicable on CPU"


def cpu_na(reason):
    """Skips a test that needs what a CPU does not have (CUDA streams, graphs, multicast, ...)."""
    return unittest.skip(f"{NOT_APPLICABLE}: {reason}")


def _world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank():
    return int(os.environ.get("RANK", "0"))


class TestCase(unittest.TestCase):
    """unittest's TestCase with PyTorch's ``assertEqual``: tensors (and a tensor against a
    number) compare with ``torch.testing.assert_close``'s tolerances for their dtype."""

    def assertEqual(self, first, second, msg=None, *, atol=None, rtol=None, exact_dtype=True, **_kw):  # noqa: N802
        if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
            try:
                _assert_tensors_equal(first, second, atol=atol, rtol=rtol, exact_dtype=exact_dtype)
            except AssertionError as e:
                raise self.failureException(_message(msg, str(e))) from None
            return
        if callable(msg):
            if first != second:
                raise self.failureException(msg(f"{first!r} != {second!r}"))
            return
        super().assertEqual(first, second, msg)


def _assert_tensors_equal(first, second, *, atol, rtol, exact_dtype):
    if not isinstance(first, torch.Tensor):
        first, second = second, first
    if not isinstance(second, torch.Tensor):
        # A number against a tensor: every element equals it (PyTorch's relaxed number pair).
        second = torch.full_like(first, second)
        exact_dtype = False
    if (atol is None) != (rtol is None):
        atol, rtol = atol or 0.0, rtol or 0.0
    torch.testing.assert_close(
        first, second, atol=atol, rtol=rtol, check_dtype=exact_dtype, check_device=False, equal_nan=True
    )


def _message(msg, detail):
    if msg is None:
        return detail
    if callable(msg):
        return msg(detail)
    return f"{detail} : {msg}"


class MultiProcContinuousTest(TestCase):
    """PyTorch's ``MultiProcContinuousTest`` on the CPU: the harness calls ``_init_pg`` before
    the test (a gloo process group over a ``FileStore`` the ranks share)."""

    #: The process group's timeout (gloo's collectives and barriers).
    timeout = timedelta(seconds=30)
    _harness_needs_pg = True

    @property
    def rank(self):
        return _rank()

    @property
    def world_size(self):
        return _world_size()

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        """The job's default process group, on gloo, met through the file ``rdvz_file``; kept
        in ``cls.pg`` as the tests expect."""
        import torch.distributed as dist

        shared = dist.FileStore(rdvz_file, world_size)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=shared, timeout=cls.timeout)
        cls.pg = dist.group.WORLD


class MultiProcessTestCase(TestCase):
    """PyTorch's ``MultiProcessTestCase`` on the CPU: the test makes its own process group
    (over ``FileStore(self.file_name, ...)``), in processes that run nothing else."""

    _harness_needs_pg = False

    def _spawn_processes(self):
        """The harness has already started one process per rank."""

    @property
    def rank(self):
        return _rank()

    @property
    def world_size(self):
        return _world_size()

    @property
    def file_name(self):
        return os.environ["UPSTREAM_STORE_FILE"]


def requires_cuda_p2p_access():
    """Upstream's gate for peer access between GPUs: ranks on a CPU share memory through symmem."""
    return lambda cls: cls


def skip_if_lt_x_gpu(n):
    """Skips unless the job has at least ``n`` ranks (upstream: GPUs, one rank each)."""

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if _world_size() < n:
                self.skipTest(f"needs at least {n} ranks")
            return fn(self, *args, **kwargs)

        return wrapper

    return decorator


def skip_but_pass_in_sandcastle_if(condition, reason):
    """Upstream's conditional skip (a plain ``unittest.skipIf`` outside Meta's CI)."""
    return unittest.skipIf(condition, reason)


def parametrize(arg_str, arg_values):
    """PyTorch's ``parametrize``: ``instantiate_parametrized_tests`` makes one test per value
    (per combination, with several of these on one test)."""
    names = [s.strip() for s in arg_str.split(",")]

    def decorator(fn):
        fn.__dict__.setdefault("_harness_params", []).insert(0, (names, list(arg_values)))
        return fn

    return decorator


class subtest:  # noqa: N801 - PyTorch's name
    """One value of a ``parametrize`` list with a name and decorators of its own (PyTorch's
    ``subtest``)."""

    def __init__(self, arg_values, name=None, decorators=()):
        self.arg_values, self.name, self.decorators = arg_values, name, list(decorators)


class MissingOp:
    """A ``torch.ops.symm_mem`` operator this torch does not have, named in a parametrize list
    (upstream's lists may name operators newer than the installed torch)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.ops.symm_mem.{self.name} (not in this torch)"


def optional_op(name):
    """``torch.ops.symm_mem.<name>``, or a ``MissingOp`` when this torch has no such operator:
    ``instantiate_parametrized_tests`` then skips the cases that use it, the others still run."""
    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return MissingOp(name)


def _missing_ops(value):
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v.name for v in values if isinstance(v, MissingOp)]


def instantiate_parametrized_tests(cls):
    """Replaces each parametrized test of ``cls`` with one test per combination of values, named
    as PyTorch names them (``test_x_dim_0``; a value without a readable name goes by index). A
    combination with an operator this torch lacks (``optional_op``) is skipped, saying which."""
    for attr, fn in list(vars(cls).items()):
        params = getattr(fn, "_harness_params", None)
        if not attr.startswith("test") or not params:
            continue
        delattr(cls, attr)
        axes = [list(enumerate(values)) for _, values in params]
        for combo in itertools.product(*axes):
            kwargs, parts, decorators = {}, [], []
            for (names, _), (index, value) in zip(params, combo):
                if isinstance(value, subtest):
                    decorators += value.decorators
                    label, value = value.name, value.arg_values
                else:
                    label = None
                missing = _missing_ops(value)
                if missing:
                    version = torch.__version__.split("+")[0]
                    ops = ", ".join(f"torch.ops.symm_mem.{m}" for m in missing)
                    decorators.append(unittest.skip(f"not applicable on torch {version}: no {ops}"))
                values = value if len(names) > 1 else (value,)
                for name, v in zip(names, values):
                    kwargs[name] = v
                parts.append(label or _param_name(names, value, index))
            name = "_".join([attr, *parts])
            test = _bind(fn, kwargs, name)
            for decorate in decorators:
                test = decorate(test)
            setattr(cls, name, test)
    return cls


def _param_name(names, value, index):
    if len(names) > 1:
        return "_".join(_one_name(n, v, index) for n, v in zip(names, value))
    return _one_name(names[0], value, index)


def _one_name(name, value, index):
    if isinstance(value, torch.dtype):
        return f"{name}_{str(value).removeprefix('torch.')}"
    if isinstance(value, (bool, int, float, str)):
        return f"{name}_{value}"
    return f"{name}{index}"


def _bind(fn, kwargs, name):
    @functools.wraps(fn)
    def test(self):
        return fn(self, **kwargs)

    test.__name__ = name
    test.__dict__.pop("_harness_params", None)
    return test


def gloo_all_to_all(output_tensor_list, input_tensor_list, group=None):
    """``dist.all_to_all`` for gloo, whose all_to_all takes equal sizes only (NCCL's takes any):
    the same exchange through ``all_to_all_single`` with split sizes, written back into
    ``output_tensor_list``."""
    import torch.distributed as dist

    out_sizes = [t.numel() for t in output_tensor_list]
    in_sizes = [t.numel() for t in input_tensor_list]
    first = output_tensor_list[0]
    received = torch.empty(sum(out_sizes), dtype=first.dtype, device=first.device)
    sent = torch.cat([t.reshape(-1) for t in input_tensor_list])
    dist.all_to_all_single(received, sent, out_sizes, in_sizes, group=group)
    for out, chunk in zip(output_tensor_list, received.split(out_sizes)):
        out.copy_(chunk.view_as(out))


def collect(module):
    """The module's tests in a stable order: [(id, TestCase instance)], id ``Class.test_name``."""
    suite = unittest.TestLoader().loadTestsFromModule(module)
    out = []

    def walk(s):
        for t in s:
            if isinstance(t, unittest.TestSuite):
                walk(t)
            else:
                out.append((f"{type(t).__name__}.{t._testMethodName}", t))

    walk(suite)
    return out


def static_skip(test):
    """The reason ``test`` is skipped before it runs (a skip decorator on it or its class), or
    None."""
    cls = type(test)
    method = getattr(cls, test._testMethodName)
    for holder in (cls, method):
        if getattr(holder, "__unittest_skip__", False):
            return getattr(holder, "__unittest_skip_why__", "") or "skipped"
    return None


class Result(unittest.TestResult):
    """The outcome of one test: ``pass``, ``fail`` or ``skip``, and its first line."""

    def __init__(self):
        super().__init__()
        self.outcome, self.detail, self.trace = "pass", "", ""

    def _failed(self, err):
        if self.outcome == "fail":
            return
        exc_type, exc, _ = err
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.outcome, self.detail = "fail", f"{exc_type.__name__}: {first}"
        self.trace = self._exc_info_to_string(err, self._current)

    def startTest(self, test):  # noqa: N802
        self._current = test
        super().startTest(test)

    def addError(self, test, err):  # noqa: N802
        self._failed(err)

    def addFailure(self, test, err):  # noqa: N802
        self._failed(err)

    def addSkip(self, test, reason):  # noqa: N802
        if self.outcome == "pass":
            self.outcome, self.detail = "skip", reason

    def addUnexpectedSuccess(self, test):  # noqa: N802
        self.outcome, self.detail = "fail", "unexpected success"


def run_one(test, store_file):
    """Runs ``test`` in this (fresh) process: the process group first where the test's base
    makes one, then the test. Returns its ``Result``."""
    result = Result()
    cls = type(test)
    if getattr(cls, "_harness_needs_pg", False):
        try:
            cls._init_pg(_rank(), _world_size(), store_file)
        except Exception as e:  # noqa: BLE001 - reported as the test's failure
            result.outcome, result.detail = "fail", f"harness: _init_pg: {type(e).__name__}: {e}"
            return result
    test.run(result)
    return result


# Upstream's gates and hardware facts, as they evaluate on a machine without CUDA devices. The
# ported files import these instead of torch.testing._internal's (port.py rewrites the imports).

#: Symmetric memory is supported on this platform (symmem's CPU backend).
PLATFORM_SUPPORTS_SYMM_MEM = True
TEST_WITH_ROCM = False
IS_WINDOWS = False
MI350_ARCH = ("gfx950",)
#: No CUDA compute capability here.
SM89OrLater = SM90OrLater = SM100OrLater = False
e4m3_type = torch.float8_e4m3fn


def getRocmVersion():  # noqa: N802 - upstream's name
    return (0, 0)


def isRocmArchAnyOf(arch):  # noqa: N802 - upstream's name
    return False


def _unchanged(*_args, **_kwargs):
    return lambda item: item


#: ROCm-only skips: never on this machine.
skip_if_rocm_multiprocess = _unchanged()
skip_if_rocm_arch_multiprocess = _unchanged
skip_if_rocm_ver_lessthan_multiprocess = _unchanged


#: ROCm-only skip: never on this machine.
skipIfRocm = _unchanged()  # noqa: N816 - upstream's name


def requires_nccl_version(version, msg):
    """Upstream's NCCL version gate: on the CPU, symmem's backend stands in for NCCL's."""
    return lambda item: item


def lazy_skip_if(condition, reason):
    """Skips when ``condition()`` is true (evaluated now: it reads no device here)."""
    return unittest.skipIf(condition(), reason)


def requires_multicast_support():
    return cpu_na("multicast (NVLink SHARP) memory")


def requires_nccl():
    return cpu_na("NCCL")


requires_cuda_python_bindings = cpu_na("CUDA Python bindings")


def get_cycles_per_ms():
    raise RuntimeError("get_cycles_per_ms: a CUDA timing helper, not on the CPU")


def setup_torchcomms_pg(**_kwargs):
    raise RuntimeError("setup_torchcomms_pg: torchcomms' NCCL backend, not on the CPU")
