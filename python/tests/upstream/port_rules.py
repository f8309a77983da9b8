"""port.py's tables: the upstream tests that cannot apply on a CPU, and this port's own tests.

``SKIPS[file]`` maps a class, or ``Class.test`` (before parametrization: every case of it), to
the reason it cannot run on a CPU; port.py puts ``@cpu_na(reason)`` on it, which the results
count as "n/a". A test is here only for what a CPU lacks (CUDA streams, events, graphs,
multicast, FP8, CUDA memory pools, NCCL or NVSHMEM themselves, Triton device code, inductor's
lowering); every other test runs, and a failure there is symmem's to fix. Upstream's own skips
(ROCm-only tests, tests needing more ranks) stay as upstream wrote them.
"""

_STREAMS = "CUDA streams"
_GRAPHS = "CUDA graphs"
_MULTIMEM = "multimem (NVLink SHARP multicast)"
_LOWERING = "inductor's lowering of symm_mem operators (CUDA/Triton code)"
_FP8 = "FP8 scaled matmul (CUDA compute capability >= 8.9)"
_USE_MEM_POOL = "CUDA memory pools (torch.cuda.use_mem_pool)"

SKIPS = {
    "test_symmetric_memory.py": {
        "SymmetricMemoryTest.test_cuda_nvlink_connectivity_detection": "NVLink connectivity between CUDA devices",
        "SymmetricMemoryTest.test_alloc_rendezvous_on_current_stream": "CUDA streams and the CUDA profiler",
        "SymmetricMemoryTest.test_rendezvous_custom_backend": "the NCCLX stub backend wraps NCCL (CUDA only)",
        "SymmetricMemoryTest.test_pg_rendezvous_abort_after": "ProcessGroupNCCL's options and the abort of its NCCL communicator",
        "SymmetricMemoryTest.test_low_contention_all_gather_ce_multicast": "copy-engine multicast (NVLink SHARP)",
        "SymmetricMemoryTest.test_low_contention_all_gather_ce_multicast_out": "copy-engine multicast (NVLink SHARP)",
        "SymmetricMemoryTest.test_cuda_multimem_barrier_kernel": "multicast (NVLink SHARP) and the CUDA profiler",
        "SymmetricMemoryTest.test_stream_serialization_barrier_two_streams": _STREAMS,
        "SymmetricMemoryTest.test_stream_serialization_put_wait_two_streams": _STREAMS,
        "SymmetricMemoryTest.test_stream_serialization_waits_on_pad_kernel_only": "CUDA streams and events",
        "SymmetricMemoryTest.test_stream_serialization_concurrent_threads": "CUDA streams and events",
        "SymmetricMemoryTest.test_stream_serialization_graph_dependency": _GRAPHS,
        "SymmetricMemoryTest.test_stream_serialization_one_shot_all_reduce": _STREAMS,
        "SymmetricMemoryTest.test_stream_serialization_cuda_graph_capture": _GRAPHS,
        "SymmetricMemoryTest.test_stream_serialization_capture_without_replay": _GRAPHS,
        "SymmetricMemoryTest.test_stream_serialization_cuda_graph_forked_streams": _GRAPHS,
        "AsyncTPTest.test_fused_all_gather_matmul_native": "the native async-TP GEMM (CUDA sm>=90) and the CUDA profiler",
        "AsyncTPTest.test_fused_all_gather_matmul_native_graph_capture": _GRAPHS,
        "AsyncTPTest.test_multimem_all_gather_matmul": "multicast (NVLink SHARP) and the CUDA profiler",
        "AsyncTPTest.test_fused_all_gather_scaled_matmul": _FP8,
        "AsyncTPTest.test_fused_matmul_reduce_scatter_bfloat16_custom_reduce": "its second half captures the fused reducer in a CUDA graph",
        "AsyncTPTest.test_fused_scaled_matmul_reduce_scatter": _FP8,
        "SymmMemCollectiveTest.test_multimem_all_reduce": _MULTIMEM,
        "SymmMemCollectiveTest.test_multimem_one_shot_all_reduce": _MULTIMEM,
        "SymmMemCollectiveTest.test_multimem_one_shot_reduce_out": _MULTIMEM,
        "SymmMemCollectiveTest.test_multimem_all_gather": _MULTIMEM,
        "SymmetricMemoryTestCudaGraph": "CUDA graphs and copy-engine multicast",
        "LoweringTest.test_lowering_one_shot_all_reduce": _LOWERING,
        "LoweringTest.test_comm_buffer_reuse": _LOWERING,
        "LoweringTest.test_output_buffer_reuse": _LOWERING,
        "LoweringTest.test_output_buffer_reuse_copy_variant": _LOWERING,
        "LoweringTest.test_low_contention_all_gather_planned_output_codegen": "copy-engine multicast and inductor's lowering",
        "LoweringTest.test_low_contention_all_gather_out_rewrite_preserves_out": "inductor's copy-engine multicast pass",
        "LoweringTest.test_external_allocation_fallback": _LOWERING,
        "LoweringTest.test_comm_buffer_inplace_prevention": _LOWERING,
        "LoweringTest.test_custom_op_symm_mem_realization": "inductor's realization of symm_mem arguments (CUDA/Triton code)",
        "LoweringTest.test_symm_mem_alloc_id_no_collision_after_reseed": "inductor's symm_mem allocation ids (CUDA/Triton code)",
        "SymmMemCleanupTest": "CUDA device-side asserts and CUDA streams in a child process",
        "SymmMemPoolTest.test_mempool_tensor_factory": _USE_MEM_POOL,
        "SymmMemPoolTest.test_mempool_compute_ops": _USE_MEM_POOL,
        "SymmMemPoolTest.test_mempool_recycled_alloc_signal_pad": _USE_MEM_POOL,
        "SymmMemPoolTest.test_mempool_large_alloc_barrier": _USE_MEM_POOL,
        "SymmMemPoolTest.test_mempool_storage_reuse": _USE_MEM_POOL,
        "TorchCommsCudaSymmMemTest": "torchcomms' NCCL backend",
        "ExternalNcclCommRegistrationTest": "NCCL communicators (ncclCommInitAll through ctypes)",
    },
    "test_nvshmem.py": {
        "NVSHMEMSymmetricMemoryTest.test_mempool_tensor_factory": "CUDA memory pools (torch.cuda.MemPool)",
        "NVSHMEMSymmetricMemoryTest.test_mempool_tensor_w_collective": "CUDA memory pools (torch.cuda.MemPool)",
        "NVSHMEMSymmetricMemoryTest.test_mempool_compute_ops": "CUDA memory pools (torch.cuda.MemPool)",
        "NVSHMEMSymmetricMemoryTest.test_handle_offset": "CUDA memory pools (torch.cuda.MemPool)",
        "NVSHMEMSymmetricMemoryTest.test_get_remote_tensor": "CUDA memory pools (torch.cuda.MemPool)",
    },
    "test_nccl.py": {
        "NCCLSymmetricMemoryTest.test_nccl_symmem_collective_cuda_graph": _GRAPHS,
        "NCCLSymmetricMemoryTest.test_nccl_symmem_tensor_creation_and_collective_cuda_graph": "CUDA graphs and streams",
        "NCCLSymmetricMemoryTest.test_nccl_symmem_cuda_graph_allocation_requires_warmup": _GRAPHS,
        "NCCLSymmetricMemoryTest.test_nccl_symmem_cached_alloc_on_other_thread_during_capture": _GRAPHS,
        "NCCLSymmetricMemoryTest.test_nccl_symmem_cuda_graph_cache_keys_exact_size": _GRAPHS,
        "NCCLSymmetricMemoryTest.test_mempool_tensor_factory": _USE_MEM_POOL,
        "NCCLSymmetricMemoryTest.test_mempool_compute_ops": _USE_MEM_POOL,
        "NCCLSymmetricMemoryTest.test_mempool_recycled_barrier": _USE_MEM_POOL,
        "NCCLSymmetricMemoryTest.test_nccl_symmem_reuse_waits_for_free_stream_zero": _STREAMS,
    },
    "symmetric_memory.md": {
        # The docs page's examples, by the names port_docs.py gives them (section, then number).
        "test_write_your_own_kernel_2": "a Triton kernel synchronizing on signal pads with PTX",
        "test_scale_out": "NVSHMEM device functions in a Triton kernel",
        "test_using_memory_pool_1": _USE_MEM_POOL,
        "test_using_memory_pool_2": _USE_MEM_POOL,
        "test_option_1_register_a_memory_pool_with_the_process_group": "ProcessGroupNCCL's mem_allocator, register_mem_pool and CUDA memory pools",
        "test_copy_engine_collectives": "copy-engine collectives: NCCL's zero-CTA policy and GPU copy engines",
        "test_rendezvous_at_scale_1": "ProcessGroupNCCL's options (use_pg_for_symm_mem_rendezvous)",
        "test_rendezvous_at_scale_2": "ProcessGroupNCCL's options and the abort of its NCCL communicator",
    },
}

# This port's own tests, appended to an upstream class. Inductor's lowering of the symm_mem
# operators is CUDA-only upstream (its tests are skipped above); what must keep working on a CPU
# is torch.compile with the eager and aot_eager backends over symmem's operators on symmetric
# CPU tensors, compared with the same function run eagerly and with gloo's all_reduce.
_COMPILED = '''
    # symmem's own (not upstream's): torch.compile's eager and aot_eager backends over the
    # symm_mem operators, against eager and against gloo's all_reduce.
    @skip_if_lt_x_gpu(2)
    @parametrize("backend", ["eager", "aot_eager"])
    def test_output_buffer_reuse_copy_variant_compiled(self, backend: str):
        self._init_process()
        n = 8
        workspace = symm_mem.empty(n * n, device=self.device).view(n, n)
        symm_mem.rendezvous(workspace, group=dist.group.WORLD.group_name)
        a = torch.rand(n, n, device=self.device)
        b = torch.rand(n, n, device=self.device)

        def reduce_product(workspace, a, b):
            return torch.ops.symm_mem.one_shot_all_reduce_copy(workspace, a @ b, "sum", "0")

        eager = reduce_product(workspace, a, b)
        compiled = torch.compile(reduce_product, fullgraph=True, backend=backend)(workspace, a, b)
        torch.testing.assert_close(compiled, eager)
        reference = a @ b
        dist.all_reduce(reference)
        torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)

    @skip_if_lt_x_gpu(2)
    @parametrize("backend", ["eager", "aot_eager"])
    def test_comm_buffer_reuse_compiled(self, backend: str):
        self._init_process()
        n = 8
        x, w1, w2 = (torch.rand(n, n, device=self.device) for _ in range(3))
        # Two symmetric buffers alive at once, written before the compiled region: aot_eager
        # functionalizes a write through out= into a fresh tensor, not a symmetric one.
        first = symm_mem.empty(n, n, device=self.device)
        second = symm_mem.empty(n, n, device=self.device)
        torch.mm(x, w1, out=first)
        torch.mm(first, w2, out=second)

        def reduce_both(p, q):
            summed_p = torch.ops.symm_mem.one_shot_all_reduce(p, "sum", "0")
            summed_q = torch.ops.symm_mem.one_shot_all_reduce(q, "sum", "0")
            return summed_p + summed_q

        eager = reduce_both(first, second)
        compiled = torch.compile(reduce_both, fullgraph=True, backend=backend)(first, second)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        reference = first + second
        dist.all_reduce(reference)
        torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)
'''

EXTRA_TESTS = {"test_symmetric_memory.py": {"LoweringTest": _COMPILED}}
