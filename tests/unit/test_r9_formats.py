"""Round-9 families (issue 15): spellings the packs did not read (an NGC
container's 802 banner, the device plugin's NVML mismatch, THC's assert
without a function name, the shell's "Killed" glued to a progress bar,
PJRT's agent error), a rendezvous address that is not valid on the host, and
NCCL skipping an HCA it cannot open (information, not a failure).

Every log line is a real one, quoted in the public thread named above it (the
same ones the rules in etc/patterns/*.toml cite); none is built from a format.
"""
from __future__ import annotations

from tests.unit.packs import fired_rules, scanner, scored_verdict  # noqa: F401 (scanner: a fixture)


# NVIDIA/TensorRT-LLM#398 (an NGC container on a p4d without fabric manager)
BANNER_802 = ["ERROR: The NVIDIA Driver is present, but CUDA failed to initialize.  GPU functionality will not be available.",
              "   [[ System not yet initialized (error 802) ]]"]
# pando85/homelab PR#4110
NVML_MISMATCH = ["Driver/library version mismatch — failed to initialize NVML"]
# NVIDIA/flowtron#52
THC_ASSERT = ["C:/cb/pytorch_1000000000000/work/aten/src/THC/THCTensorIndex.cu:218: block: [0,0,0], thread: [106,0,0] Assertion `srcIndex < srcSelectDimSize` failed."]
# chatchat-space/Langchain-Chatchat#35
KILLED_ON_BAR = ["Loading checkpoint shards:  38%|██████▊           | 3/8 [00:02<00:03,  1.28it/s]Killed"]
# google/paxml#77
AGENT_ERROR = ["> 2024-04-12 23:39:41.656900: E external/xla/xla/pjrt/distributed/client.cc:96] Coordination service agent in error status: DEADLINE_EXCEEDED: Deadline Exceeded"]


def test_spellings_the_packs_now_read(scanner):
    assert fired_rules(scanner, BANNER_802) == ["cuda.system_not_ready"]
    assert fired_rules(scanner, NVML_MISMATCH) == ["kernel.driver_unavailable"]
    v = scored_verdict(scanner, THC_ASSERT)
    assert (v.category, v.action) == ("application", "stop")
    v = scored_verdict(scanner, KILLED_ON_BAR)
    assert (v.category, v.action) == ("oom", "stop")
    v = scored_verdict(scanner, AGENT_ERROR)
    assert (v.category, v.action) == ("nccl_timeout_hang", "requeue")


# LarryJane491/Lora-Training-in-Comfy#27 (EADDRNOTAVAIL on Windows); the retry
# of a timed-out connect (HyBrIK's default address) stays information
ADDRESS_INVALID = ["[W socket.cpp:697] [c10d] The client socket has failed to connect to [AH-DellXPS]:29500 (system error: 10049 - The requested address is not valid in its context.)."]
CONNECT_TIMED_OUT = ["    [W socket.cpp:663] [c10d] The client socket has failed to connect to [::ffff:192.168.1.219]:23456 (errno: 110 - Connection timed out)."]


def test_a_rendezvous_address_not_valid_here_is_the_launch_configuration(scanner):
    v = scored_verdict(scanner, ADDRESS_INVALID)
    assert (v.category, v.action) == ("application", "stop")
    assert not fired_rules(scanner, CONNECT_TIMED_OUT)


# zai-org/ImageReward#65: the pod is shown only some HCAs; NCCL goes on
HCA_SKIPPED = [
    "65826-86bd789679-2dxbs:80744:80744 [1] transport/net_ib.cc:149 NCCL WARN NET/IB : Unable to open device mlx5_58",
    "65826-86bd789679-2dxbs:80746:80746 [3] NCCL INFO NET/IB : Using [0]mlx5_1:1/RoCE [1]mlx5_18:1/RoCE ; OOB eth0:33.117.221.247<0>",
]


def test_an_hca_nccl_skips_fires_nothing(scanner):
    assert not fired_rules(scanner, HCA_SKIPPED)
    assert scored_verdict(scanner, HCA_SKIPPED).action == "none"


# faceswap#699 (deepfakes/faceswap) and apple/turicreate#2842: the work was saved,
# then a destructor raised during interpreter teardown
IGNORED_AT_EXIT = [
    "04/07/2019 11:39:53 INFO     saved models",
    "Exception ignored in: <bound method BaseSession.__del__ of <tensorflow.python.client.session.Session object at 0x7fbb0005b9b0>>",
    "Traceback (most recent call last):",
    '  File "/usr/local/lib/python3.5/dist-packages/tensorflow/python/client/session.py", line 738, in __del__',
    "TypeError: 'NoneType' object is not callable",
]


def test_an_exception_python_ignored_is_not_the_programs_failure(scanner):
    assert not fired_rules(scanner, IGNORED_AT_EXIT)
    assert scored_verdict(scanner, IGNORED_AT_EXIT).action == "none"
    # the same traceback without the hook's line is the program's error
    assert scored_verdict(scanner, IGNORED_AT_EXIT[2:]).action == "stop"


# wandb/wandb#341: the run synced, then tqdm's destructor raised at shutdown
# (the snippet ends at the traceback's header)
IGNORED_UNFINISHED = [
    "wandb: Synced mnist_stylegan_baseline: https://app.wandb.ai/angle-tech/lab/runs/1s9ymt1c",
    "Exception ignored in: <bound method tqdm.__del__ of Size: 16; G: 28.247; D: 14.896; Grad: 1.000; Alpha: 1.00000:   0% 277/3000000 [02:03<249:42:34,  3.34it/s]>",
    "Traceback (most recent call last):",
]


def test_an_ignored_exceptions_cut_traceback_fires_nothing(scanner):
    assert not fired_rules(scanner, IGNORED_UNFINISHED)
    assert fired_rules(scanner, IGNORED_UNFINISHED[2:]) == ["python.traceback_unfinished"]


# leptonai/gpud PR#482
IBSTAT_POLLING = [
    "CA 'mlx5_10'",
    "    CA type: MT4129",
    "    Number of ports: 1",
    "    Firmware version: 28.39.1002",
    "    Hardware version: 0",
    "    Node GUID: ...",
    "    System image GUID: ...",
    "    Port 1:",
    "        State: Down",
    "        Physical state: Polling",
    "        Rate: 10",
    "        Base lid: 868"
]
# huggingface/huggingface_hub#2060
HTTP_503 = [
    "requests.exceptions.HTTPError: 503 Server Error: Service Temporarily Unavailable for url: https://huggingface.co/timm/vit_large_patch16_384.augreg_in21k_ft_in1k/resolve/main/model.safetensors"
]
# AgentR1/Agent-R1#33
ACTOR_DIED = [
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."
]
# NVIDIA/nccl#1099
BOOTSTRAP_TRACE = [
    "nd20-01:191191:219889 [0] NCCL INFO misc/socket.cc:564 -> 2",
    "nd20-01:191191:219889 [0] NCCL INFO misc/socket.cc:615 -> 2",
    "nd20-01:191191:219889 [0] NCCL INFO bootstrap.cc:270 -> 2",
    "nd20-01:191191:219889 [0] NCCL INFO init.cc:1303 -> 2",
    "nd20-01:191191:219889 [0] NCCL INFO group.cc:64 -> 2 [Async thread]",
    "nd20-01:191191:191191 [0] NCCL INFO group.cc:422 -> 2",
    "nd20-01:191191:191191 [0] NCCL INFO group.cc:106 -> 2 "
]
# dongjun-Lee/text-classification-models-tf#4
TF1_OOM = [
    "ResourceExhaustedError (see above for traceback): OOM when allocating tensor of shape [563354,256] and type float"
]
# kubeflow/kubeflow#1261
EVICTED = [
    "`The node was low on resource: memory.`",
    "`Killing container with id docker://notebook:Need to kill Pod`"
]


def test_more_round_9_families(scanner):
    v = scored_verdict(scanner, IBSTAT_POLLING)
    assert (v.category, v.action) == ("interconnect", "requeue_exclude")
    v = scored_verdict(scanner, HTTP_503)
    assert (v.category, v.action) == ("system_software", "requeue")
    v = scored_verdict(scanner, ACTOR_DIED)
    assert (v.category, v.action) == ("system_software", "requeue")    # a symptom: no stop
    v = scored_verdict(scanner, BOOTSTRAP_TRACE)
    assert (v.category, v.action) == ("interconnect", "requeue")
    assert scored_verdict(scanner, BOOTSTRAP_TRACE[3:]).action == "none"   # init.cc/group.cc traces alone say nothing
    v = scored_verdict(scanner, TF1_OOM)
    assert (v.category, v.action) == ("oom", "stop")
    v = scored_verdict(scanner, EVICTED)
    assert (v.category, v.action) == ("oom", "requeue")
