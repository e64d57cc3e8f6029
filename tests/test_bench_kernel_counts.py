"""bench.kernel_counts: the kernels Inductor writes for a step, stock against erase (CPU)."""
import torch

from bench import kernel_counts
from bench.kernel_counts import KernelCounts

CPU = torch.device("cpu")

CODE = '''
cpp_fused_relu_0 = async_compile.cpp_pybinding(['float*'], r"""...""")
cpp_fused_sum_1 = async_compile.cpp_pybinding(['float*'], r"""...""")
def call(args):
    # Topologically Sorted Source Nodes: [linear], Original ATen: [aten.addmm]
    # extern_kernels.addmm is named here in a comment only
    extern_kernels.addmm(primals_2, primals_3, reinterpret_tensor(primals_1, (16, 8)), out=buf0)
    buf1 = torch.ops.aten.convolution_backward.default(buf0, primals_4, primals_5, [0], [1])
    extern_kernels.mm(buf0, primals_6, out=buf2)
    cpp_fused_relu_0(buf2)
'''


def test_counts_read_definitions_and_calls_not_comments():
    counts = KernelCounts.of([CODE, "extern_kernels.mm(a, b, out=c)\n"])
    assert counts == KernelCounts(modules=2, fused=2,
                                  externs={"addmm": 1, "convolution_backward": 1, "mm": 2},
                                  names={"cpp_fused_relu": 1, "cpp_fused_sum": 1})
    one = KernelCounts.of([CODE.replace("cpp_fused_sum_1", "cpp_fused_relu_1")])
    assert one.names == {"cpp_fused_relu": 2}
    assert one.beyond(counts) == {"cpp_fused_relu": 1} and counts.beyond(one) == {
        "cpp_fused_sum": 1}


def test_segments_keep_the_matrix_work_and_add_the_modules_of_their_boundaries():
    # NB: that a graph with no early block compiles to stock's code is
    # tests/test_stock_inductor.py's (the code itself compared)
    stock, erase = (kernel_counts.count_step("mlp:8:16:32:3", backend, CPU)
                    for backend in kernel_counts.BACKENDS)
    assert stock.fused > 0 and stock.modules == 2
    assert erase.externs == stock.externs and sum(stock.externs.values()) > 0
    assert erase.modules > stock.modules and erase.fused >= stock.fused
    assert sum(erase.beyond(stock).values()) - sum(stock.beyond(erase).values()) == (
        erase.fused - stock.fused)
