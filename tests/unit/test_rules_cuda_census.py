"""CUDA formats the census of the runtime, driver and math-library error strings
added to cuda.toml (issue 15, round 4): invalid arguments and resource handles
and device pointers (the program's), a kernel symbol missing for this GPU
(the build's), a vGPU without a GRID license (the node's), the runtime
unloading at exit (teardown noise), the math libraries' status names as
PyTorch prints them (a failed execution is retried, a refused call is the
program's, cuFFT's and old THC's allocation failures are OOMs), and the driver API's
CUresult names for errors the runtime's names already covered.

Every line is a real one, quoted in the public thread the rule's comment in
etc/patterns/cuda.toml names; none is built from a format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext, context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# Comfy-Org/ComfyUI#10862: the error and PyTorch's hint lines after it
INVALID_ARG_BLOCK = [
    "RuntimeError: CUDA error: invalid argument",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
]
# MCG-NJU/MOC-Detector#22, kuangliu/pytorch-cifar#88 (old THC, CUDA <= 9 numbering)
THC_INVALID = ("RuntimeError: cuda runtime error (11) : invalid argument at "
               "/opt/conda/conda-bld/pytorch_1535491974311/work/aten/src/THC/THCGeneral.cpp:663")
THC_CHECK_INVALID = "THCudaCheck FAIL file=/pytorch/aten/src/THC/THCGeneral.cpp line=383 error=11 : invalid argument"
# ggml-org/llama.cpp#2503, NVIDIA/caffe#271
GGML_HANDLE = "CUDA error 400 at ggml-cuda.cu:5207: invalid resource handle"
CAFFE_HANDLE = "ERROR: Check failed: error == cudaSuccess (33 vs. 0) invalid resource handle"
# torch/cutorch#537 (Lua torch's THC, CUDA 17)
THC_DEVPTR = ("THCudaCheck FAIL file=/var/storage/shared/mscog/t-subhup/pkg/torch/extra/cutorch/lib/THC/"
              "THCGeneral.c line=634 error=17 : invalid device pointer")
# NVIDIA/nccl#1372 (NCCL built for sm_80 run on H100s), NVIDIA/stdexec#888
NCCL_SYMBOL = "gcn75:2336636:2336906 [0] enqueue.cc:58 NCCL WARN Cuda failure 'named symbol not found'"
STDEXEC_SYMBOL = ("CUDA error cudaErrorSymbolNotFound [/home/eniebler/Code/stdexec/include/nvexec/stream/"
                  "bulk.cuh:239]: named symbol not found")
# NVIDIA-AI-IOT/jetbot#474: TensorRT's log line, harmless there ("won't crash the program")
TRT_HANDLE = "[TensorRT] ERROR: 1: [slice.cu::launchNaiveSliceImpl::148] Error Code 1: Cuda Runtime (invalid resource handle)"
# abetlen/llama-cpp-python#904
GRID = ("CUDA error 102 at /tmp/pip-install-7_e6fm5e/llama-cpp-python_bce7693afa4f423faad647793d7b8412/"
        "vendor/llama.cpp/ggml-cuda.cu:7100: device doesn't have valid Grid license")
# awslabs/amazon-eks-ami#2443 (nvidia-smi's header on a GRID-driver node)
SMI_HEADER = "| NVIDIA-SMI 570.172.08             Driver Version: 570.172.08     CUDA Version: 12.8     |"
# Hangz-nju-cuhk/Rotate-and-Render#7 (at exit, results fine), BVLC/caffe#4541,
# AlexeyAB/darknet#1829, MrNeRF/LichtFeld-Studio#864
SHUTDOWN_BLOCK = [
    "terminate called after throwing an instance of 'c10::Error'",
    "  what():  CUDA error: driver shutting down",
]
CAFFE_SHUTDOWN = ("F0729 11:47:14.163569  1196 syncedmem.hpp:31] Check failed: error == cudaSuccess "
                  "(29 vs. 0)  driver shutting down")
DARKNET_SHUTDOWN = "cudaStreamDestroy() failed. Reason: driver shutting down"
LICHTFELD_SHUTDOWN = ("pinned_memory_allocator.cpp:270  CUDA error at C:\\Users\\miriam\\OneDrive\\Desktop\\"
                      "LichtFeld-Studio\\src\\core\\tensor\\pinned_memory_allocator.cpp:270 - "
                      "cudaErrorCudartUnloading: driver shutting down")
# pytorch/pytorch#89556 (RTX 4090 with a CUDA 11.6 build), the notebook's traceback
CUFFT_BLOCK = [
    "----> 2 torch.fft.fft2(aa)",
    "",
    "RuntimeError: cuFFT error: CUFFT_INTERNAL_ERROR",
]
# nerdyrodent/VQGAN-CLIP#143, jzhangbs/Vis-MVSNet#38, CannyLab/tsne-cuda#134,
# pytorch/pytorch#55032, yeyupiaoling/AudioClassification-PaddlePaddle#9
CUSOLVER = "RuntimeError: cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `cusolverDnCreate(handle)`"
CUSOLVER_NUM = "RuntimeError: cusolver error: 7, when calling `cusolverDnCreate(handle)`"
CUSPARSE = ("Initializing cuda handles... CUSPARSE error in file '/home/conda/feedstock_root/build_artifacts/"
            "tsnecuda_1667410383090/work/src/util/cuda_utils.cu', line 154, error CUSPARSE_STATUS_NOT_INITIALIZED")
CUFFT_PLAN = "  what():  cuFFT error: CUFFT_INVALID_PLAN (CUFFT_CHECK at /pytorch/aten/src/ATen/native/cuda/CuFFTUtils.h:70)"
PADDLE_CUFFT = ("  [Hint: 'CUFFT_INTERNAL_ERROR'. Driver or internal cuFFT library error] "
                "(at /paddle/paddle/phi/kernels/funcs/cufft_util.h:127)")
# pytorch/tutorials#2123, opendatalab/MinerU#1508 (bf16 on an M40)
CUBLAS_INVALID = ("RuntimeError: CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling `cublasSgemm( handle, "
                  "opa, opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`")
CUBLAS_BF16 = ("RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmStridedBatchedEx("
               "handle, opa, opb, (int)m, (int)n, (int)k, (void*)&falpha, a, CUDA_R_16BF, (int)lda, stridea, "
               "b, CUDA_R_16BF, (int)ldb, strideb, (void*)&fbeta, c, CUDA_R_16BF, (int)ldc, stridec, "
               "(int)num_batches, compute_type, CUBLAS_GEMM_DEFAULT_TENSOR_OP)`")
# pppLang/SKNet#14, twhui/LiteFlowNet3#6 (Caffe)
CUDNN_NOT_SUPPORTED = ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you "
                       "passed in a non-contiguous input.")
CAFFE_BAD_PARAM = "Check failed: status == CUDNN_STATUS_SUCCESS (3 vs. 0)  CUDNN_STATUS_BAD_PARAM"
# LiheYoung/ST-PlusPlus#38: the traceback's tail
BAD_PARAM_TB = [
    '  File "/home/daeun/anaconda3/envs/cuda114/lib/python3.8/site-packages/torch/nn/modules/conv.py", '
    'line 419, in _conv_forward',
    "    return F.conv2d(input, weight, self.bias, self.stride,",
    "RuntimeError: cuDNN error: CUDNN_STATUS_BAD_PARAM",
]
# pytorch/pytorch#6511, cupy/cupy#1063
CUFFT_ALLOC = "RuntimeError: cuFFT error: CUFFT_ALLOC_FAILED"
CUPY_CUFFT_ALLOC = "cupy.cuda.cufft.CuFftError: CUFFT_ALLOC_FAILED"
# jiesutd/NCRFpp#121: old THC's OOM, the check line and the traceback's tail of one log
THC_OOM_TB = [
    "THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=58 error=2 : out of memory",
    "Traceback (most recent call last):",
    '  File "main.py", line 445, in <module>',
    "    train(data)",
    "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/torch/lib/THC/generic/THCStorage.cu:58",
]


def _dets(lines):
    return SCANNER.scan_lines(lines)


def _rules(line):
    return sorted({d.rule for d in _dets([line])})


def _verdict(lines, **known):
    return attribute(_dets(lines), context_from_lines(lines, **known))


@pytest.mark.parametrize("line, rule", [
    (INVALID_ARG_BLOCK[0], "cuda.invalid_call"),
    (THC_INVALID, "cuda.invalid_call"),
    (THC_CHECK_INVALID, "cuda.invalid_call"),
    (GGML_HANDLE, "cuda.invalid_call"),
    (CAFFE_HANDLE, "cuda.invalid_call"),
    (THC_DEVPTR, "cuda.invalid_call"),
    (NCCL_SYMBOL, "cuda.no_kernel_image"),
    (STDEXEC_SYMBOL, "cuda.no_kernel_image"),
    (GRID, "cuda.grid_license"),
    (SHUTDOWN_BLOCK[1], "cuda.driver_shutting_down"),
    (CAFFE_SHUTDOWN, "cuda.driver_shutting_down"),
    (DARKNET_SHUTDOWN, "cuda.driver_shutting_down"),
    (LICHTFELD_SHUTDOWN, "cuda.driver_shutting_down"),
    (CUFFT_BLOCK[2], "cuda.library_error"),
    (CUSOLVER, "cuda.library_error"),
    (CUSOLVER_NUM, "cuda.library_error"),
    (CUSPARSE, "cuda.library_error"),
    (CUFFT_PLAN, "cuda.library_error"),
    (PADDLE_CUFFT, "cuda.library_error"),
    (CUBLAS_INVALID, "cuda.library_unsupported"),
    (CUBLAS_BF16, "cuda.library_unsupported"),
    (CUDNN_NOT_SUPPORTED, "cuda.library_unsupported"),
    (CAFFE_BAD_PARAM, "cuda.library_unsupported"),
    (BAD_PARAM_TB[2], "cuda.library_unsupported"),
    (CUFFT_ALLOC, "cuda.cufft_alloc_failed"),
    (CUPY_CUFFT_ALLOC, "cuda.cufft_alloc_failed"),
    (THC_OOM_TB[0], "cuda.thc_out_of_memory"),
    (THC_OOM_TB[4], "cuda.thc_out_of_memory"),
])
def test_one_line_one_rule(line, rule):
    # the specific rule outranks cuda.error_generic, cuda.thc_check_fail and
    # python.runtime_error on its line
    assert _rules(line) == [rule]


@pytest.mark.parametrize("line", [SMI_HEADER, INVALID_ARG_BLOCK[1], INVALID_ARG_BLOCK[3]])
def test_benign_neighbours_stay_quiet(line):
    assert _dets([line]) == []


def test_tensorrt_log_line_is_not_the_runtime_printing_the_error():
    # TensorRT's own "Cuda Runtime (...)" log line is not a printer this rule reads
    assert "cuda.invalid_call" not in _rules(TRT_HANDLE)


@pytest.mark.parametrize("lines", [INVALID_ARG_BLOCK, [THC_CHECK_INVALID, THC_INVALID], [GGML_HANDLE]])
def test_invalid_argument_or_handle_is_the_program(lines):
    # before: cuda.error_generic (requeue) for the new wording, thc_check_fail for THC
    verdict = _verdict(lines)
    assert verdict.category == "cuda_error"
    assert verdict.action == "stop"
    assert verdict.nodes == ()


@pytest.mark.parametrize("line", [NCCL_SYMBOL, STDEXEC_SYMBOL])
def test_kernel_symbol_missing_for_this_gpu_is_the_build(line):
    # before: nccl.cuda_failure / cuda.error_generic (requeue): a library or
    # program built without this GPU's architecture repeats on every retry
    verdict = _verdict([line])
    assert verdict.category == "application"
    assert verdict.action == "stop"


def test_unlicensed_vgpu_excludes_the_node():
    verdict = _verdict([GRID], nodes=("gpu07",))
    assert verdict.category == "system_software"
    assert verdict.action == "requeue_exclude"
    assert verdict.nodes == ("gpu07",)


@pytest.mark.parametrize("lines", [SHUTDOWN_BLOCK, [CAFFE_SHUTDOWN], [DARKNET_SHUTDOWN] * 3])
def test_runtime_unloading_at_exit_decides_nothing(lines):
    # before: "CUDA error: driver shutting down" was cuda.error_generic (a CUDA fault, requeue)
    verdict = _verdict(lines)
    assert verdict.category != "cuda_error"
    assert verdict.action in ("none", "requeue")


def test_teardown_noise_does_not_hide_the_error_before_it():
    verdict = _verdict([CUBLAS_BF16, *SHUTDOWN_BLOCK])
    assert verdict.category == "cuda_error"
    assert verdict.action == "stop"


@pytest.mark.parametrize("lines", [CUFFT_BLOCK, [CUSOLVER], [CUSPARSE], [CUFFT_PLAN]])
def test_math_library_failures_are_retried(lines):
    # before: cuFFT's and cuSOLVER's PyTorch wording fell to python.runtime_error (stop)
    verdict = _verdict(lines)
    assert verdict.category == "cuda_error"
    assert verdict.action == "requeue"


@pytest.mark.parametrize("lines", [[CUBLAS_INVALID], [CUBLAS_BF16], [CUDNN_NOT_SUPPORTED], BAD_PARAM_TB])
def test_math_library_refusals_are_the_program(lines):
    verdict = _verdict(lines)
    assert verdict.category == "cuda_error"
    assert verdict.action == "stop"


@pytest.mark.parametrize("line", [CUFFT_ALLOC, CUPY_CUFFT_ALLOC])
def test_cufft_allocation_failure_is_an_oom(line):
    verdict = _verdict([line])
    assert verdict.category == "oom"
    assert verdict.action == "stop"


def test_old_thc_out_of_memory_is_an_oom():
    # before: thc_check_fail (cuda_error, requeue) and python.runtime_error (application)
    verdict = _verdict(THC_OOM_TB)
    assert verdict.category == "oom"
    assert verdict.action == "stop"


@pytest.mark.parametrize("name, rule", [
    ("CUDA_ERROR_DEVICE_UNAVAILABLE", "cuda.devices_unavailable"),
    ("CUDA_ERROR_NO_BINARY_FOR_GPU", "cuda.no_kernel_image"),
    ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "cuda.driver_too_old"),
    ("CUDA_ERROR_STUB_LIBRARY", "cuda.driver_too_old"),
    ("CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "cuda.driver_too_old"),
    ("CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "cuda.driver_too_old"),
    ("CUDA_ERROR_DEVICE_NOT_LICENSED", "cuda.grid_license"),
    ("CUDA_ERROR_INVALID_VALUE", "cuda.invalid_call"),
    ("CUDA_ERROR_INVALID_HANDLE", "cuda.invalid_call"),
    ("CUDA_ERROR_NOT_FOUND", "cuda.no_kernel_image"),
    ("CUDA_ERROR_DEINITIALIZED", "cuda.driver_shutting_down"),
    ("cudaErrorPriorLaunchFailure", "cuda.launch_failure"),
])
def test_driver_api_names_reach_the_same_rule_as_the_runtime_text(name, rule):
    # the CUresult / cudaError_t identifiers themselves (cuGetErrorName,
    # cudaGetErrorName), as the packs' regexes list them: not log lines
    rules = {r.id: r for r in load_rules()}
    assert rules[rule].compiled.search(name)
