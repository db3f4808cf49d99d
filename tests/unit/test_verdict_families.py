"""Verdicts by failure family (issue 15): symptoms and exit reports are not
causes, where a segfault happened, CUDA errors that may be the GPU, a timeout
after the work was done, store and rendezvous failures, full disks against
transient write errors, and what the job's earlier attempts add.

Every log line here is a real one, copied from the row of the public tune split
or the dev corpus named above it (``tests/fixtures/corpus``; the row's ``source``
is the public thread). Most tests hand attribution detections with an explicit
role and action, so that they check the verdict logic whatever the packs'
current rules say; a few run the shipped packs end to end.
"""
from __future__ import annotations

from recovery_agent.detect.attempts import PriorAttempt, across_attempts
from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.detect.model import Detection, Evidence, Verdict
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.decide.policy import History, decide

SCANNER = Scanner(load_rules(), engine="re")


def det(text: str, category: str, role: str = "cause", action: str = "stop", *,
        line: int = 1, rule: str = "test.rule", severity: str = "error",
        host: str | None = None, source: str = "job.log", **more) -> Detection:
    return Detection(rule=rule, category=category, severity=severity, action_hint=action,
                     role=role, host=host, evidence=(Evidence(text, source, line),),
                     **more)


# ho-picongpu198-srun-exit1-from-killall
TASK_EXIT = "srun: error: taurusi2031: tasks 10-11: Exited with exit code 1"
# ho-pytorch150916-elastic-agent-received-15-death-signal
SIGTERM_TEARDOWN = ("W0409 07:28:49.531000 1359 torch/distributed/elastic/multiprocessing/"
                    "api.py:897] Sending process 1365 closing signal SIGTERM")
# hafs101-srun-bus-error
STEP_CANCELLED = "slurmstepd: error: *** STEP 3495450.0 ON orion-01-04 CANCELLED AT 2021-10-27T20:22:22 ***"
# basicsr737-watchdog-default-pg
WATCHDOG = ("[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, "
            "NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 "
            "milliseconds before timing out.")
# slime1486-megatron-validate-args-assert
ASSERTION = ("[rank14]: AssertionError: Number of layers should be divisible by the "
             "pipeline-model-parallel size")
# jittorllms94-torch-distributed-not-a-package
IMPORT_ERROR = ("ModuleNotFoundError: No module named 'torch.distributed.run'; "
                "'torch.distributed' is not a package")
# ipassr9-torch-cuda-oom-old-format
CUDA_OOM = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.73 GiB "
            "(GPU 0; 8.00 GiB total capacity; 17.20 GiB already allocated; 0 bytes free; "
            "19.15 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory "
            "try setting max_split_size_mb to avoid fragmentation.  See documentation for "
            "Memory Management and PYTORCH_CUDA_ALLOC_CONF")
# ho-pytorchunet258-spatial-nll-assert
DEVICE_ASSERT = "RuntimeError: CUDA error: device-side assert triggered"
# ho-vllm13673-v1-specdec-illegal-memory-access-core
ILLEGAL_ADDRESS = ("ERROR 02-21 06:30:25 core.py:291] RuntimeError: CUDA error: an illegal "
                   "memory access was encountered")
# deepseekmoe47-watchdog-unspecified-launch-failure
LAUNCH_FAILURE = ("[rank1]:[E410 01:50:33.889423318 ProcessGroupNCCL.cpp:1895] [PG ID 0 PG GUID "
                  "0(default_pg) Rank 1] Process group watchdog thread terminated with "
                  "exception: CUDA error: unspecified launch failure")
# ho-gpuburn1-aer-surprise-down-then-xid79
XID79 = "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus."
# gpud-xid13-sm-warp-exception
XID13 = ("[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', "
         "name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal "
         "Instruction Parameter")
# ho-chainer7586-ompi-segv-libnccl-mlx4 (Open MPI's signal report and backtrace)
OMPI_SEGV = ["Signal: Segmentation fault (11)",
             "Signal code: Address not mapped (1)",
             "[ 0] /lib/x86_64-linux-gnu/libpthread.so.0(+0x11390)[0x7ff32df7d390]",
             "[ 1] /usr/lib/libibverbs/libmlx4-rdmav2.so(+0x1aee)[0x7ff320091aee]",
             "[ 2] /usr/lib/x86_64-linux-gnu/libnccl.so.2(+0x2b136)[0x7ff2bf5c3136]"]
# ho-nccl1050-sigsegv-pncclreducescatter-random (UCX's report, symbols only)
UCX_SEGV = ["[ib-vm-61:343042:0:345015] Caught signal 11 (Segmentation fault: invalid "
            "permissions for mapped object at address 0x1454012e46c0)",
            "==== backtrace (tid: 345015) ====",
            " 0 0x0000000000042520 __sigaction()  ???:0",
            " 1 0x00000000000bde56 pncclReduceScatter()  ???:0"]
# ho-segger30-sigsegv-libcuda-cuctxgetdevice-driver580 (UCX's handler frames first)
UCX_SEGV_LIBCUDA = ["[photon:943812:0:943812] Caught signal 11 (Segmentation fault: Sent by "
                    "the kernel at address (nil))",
                    " 0  .../site-packages/libucx/lib/libucs.so(ucs_handle_error+0x294) "
                    "[0x7f09d5a3e024]",
                    " 1  .../site-packages/libucx/lib/libucs.so(+0x321df) [0x7f09d5a3e1df]",
                    " 3  /lib64/libc.so.6(+0x3fc30) [0x7f0cf643fc30]",
                    " 4  /lib64/libcuda.so.1(+0x31a708) [0x7f0c59f1a708]"]
# ho-inplaceabn37-zsh-segfault-missing-extension-build
SHELL_SEGV = ("[1]  27994 segmentation fault CUDA_VISIBLE_DEVICES=0 python "
              "test_vistas_single_gpu.py ... ")
# ho-autocast381-post-fit-allreduce-watchdog
FIT_DONE = "`Trainer.fit` stopped: `max_epochs=N` reached."
POST_FIT_TIMEOUT = "[Rank 0] Watchdog caught collective operation timeout:"
# ho-sglang20859-tcpstore-reset-after-hicache-hang
STORE_RECV = ("[rank12]:[W318 10:00:41.915284135 TCPStore.cpp:125] [c10d] recvValue failed on "
              "SocketImpl(fd=135, addr=[sglang-0-1.sglang.default.svc.transwarp.local]:48750, "
              "remote=[sglang-0.default.pod.transwarp.local]:20000): Connection reset by peer")
# ho-mockingbird774-errno28-after-8-days
ENOSPC = "OSError: [Errno 28] No space left on device"
# ho-nccl342-posix-fallocate-docker-64mb-shm
SHM_ENOSPC = ["include/shm.h:28 NCCL WARN Call to posix_fallocate failed: No space left on device",
              "include/shm.h:48 NCCL WARN Error while creating shared memory segment "
              "nccl-shm-recv-250a7cc850ba9298-0-1-3 (size 9637888)"]
# pytorch10577-torch-save-io-error-disk-full
WRITE_EIO = "RuntimeError: write(): fd 29 failed with Input/output error"
# ho-nccl1698-ib-status12-intermittent-retry-passes
IB_PEER = ("mycl-g2:353236:353423 [6] transport/net_ib.cc:2244 NCCL WARN NET/IB: Got completion "
           "from peer 192.168.3.5<53908> with status=12 opcode=129 len=1048576 vendor err 129 "
           "(Recv) localGid ::ffff:192.168.6.3 remoteGids::ffff:192.168.6.5 hca mlx5_10")


def frames(lines: list[str], first: Detection) -> list[Detection]:
    """The fault report, then its backtrace lines as context (info) detections."""
    return [first] + [det(text, "segfault", "symptom", "none", severity="info", line=n)
                      for n, text in enumerate(lines[1:], 2)]


# -- 1. symptoms and exit reports are not causes -----------------------------------

def test_exit_reports_alone_are_an_unexplained_failure_never_application():
    found = [det(SIGTERM_TEARDOWN, "system_software", "exit", "requeue", line=1),
             det(TASK_EXIT, "application", "exit", "stop", line=2, host="taurusi2031"),
             det(STEP_CANCELLED, "system_software", "exit", "requeue", line=3)]
    verdict = attribute(found)
    assert (verdict.blame, verdict.action, verdict.unexplained) == ("unknown", "requeue", True)
    assert verdict.category != "application" and verdict.nodes == ()
    assert "unexplained" in verdict.reason


def test_an_exit_code_has_no_layer_a_signal_keeps_its_own():
    assert attribute([det(TASK_EXIT, "application", "exit", "stop")]).category is None
    verdict = attribute([det(STEP_CANCELLED, "segfault", "exit", "stop")])
    assert (verdict.category, verdict.action) == ("segfault", "requeue")


def test_survivor_timeouts_alone_requeue_as_the_symptoms_layer():
    found = [det(WATCHDOG, "nccl_timeout_hang", "symptom", "requeue", line=1),
             det(TASK_EXIT, "application", "exit", "stop", line=2)]
    verdict = attribute(found)
    assert (verdict.category, verdict.action, verdict.blame) == ("nccl_timeout_hang", "requeue",
                                                                 "unknown")
    assert verdict.unexplained and verdict.rests_on == (0,)


def test_a_symptom_asking_to_exclude_excludes_nothing():
    verdict = attribute([det(WATCHDOG, "interconnect", "symptom", "requeue_exclude")])
    assert (verdict.blame, verdict.action, verdict.nodes) == ("unknown", "requeue", ())


def test_positive_application_evidence_before_the_echoes_stops():
    for line, category in [(ASSERTION, "application"), (IMPORT_ERROR, "application"),
                           (CUDA_OOM, "oom"), (DEVICE_ASSERT, "application")]:
        found = [det(line, category, "cause", "stop", line=1),
                 det(WATCHDOG, "nccl_timeout_hang", "symptom", "requeue", line=2),
                 det(TASK_EXIT, "application", "exit", "stop", line=3)]
        verdict = attribute(found)
        assert (verdict.blame, verdict.action) == ("application", "stop"), line
        assert not verdict.unexplained


def test_shipped_packs_end_to_end_exit_and_oom():
    verdict = attribute(SCANNER.scan_lines(["picongpu: Kein Prozess abgebrochen", TASK_EXIT]))
    assert verdict.action != "stop" and verdict.blame != "application"
    verdict = attribute(SCANNER.scan_lines([CUDA_OOM]))
    assert (verdict.category, verdict.action, verdict.blame) == ("oom", "stop", "application")


def test_policy_requeues_an_unexplained_failure_within_the_unknown_budget():
    verdict = attribute([det(TASK_EXIT, "application", "exit", "stop")])
    first = decide(verdict, history=History(unknown_requeues=0))
    assert (first.action, first.rule) == ("requeue", "unexplained")
    spent = decide(verdict, history=History(unknown_requeues=1))
    assert (spent.action, spent.rule) == ("stop", "unknown_budget")
    assert "unexplained" in spent.reason


def test_an_unexplained_timeout_keeps_the_hang_rule_and_the_budget():
    verdict = attribute([det(WATCHDOG, "nccl_timeout_hang", "symptom", "requeue")])
    assert decide(verdict).rule == "hang"
    assert decide(verdict, history=History(unknown_requeues=1)).rule == "unknown_budget"


def test_the_checkpoint_guard_still_bounds_an_unexplained_failure():
    verdict = attribute([det(TASK_EXIT, "application", "exit", "stop")])
    d = decide(verdict, history=History(attempts_without_ckpt=3, tracks_checkpoints=True))
    assert (d.action, d.rule) == ("stop", "no_progress")


# -- 2. where a segfault happened ---------------------------------------------------

def test_a_segfault_inside_the_fabric_libraries_is_requeued():
    verdict = attribute(frames(OMPI_SEGV, det(OMPI_SEGV[0], "segfault")))
    assert (verdict.action, verdict.blame) == ("requeue", "unknown")
    assert "libmlx4-rdmav2.so" in verdict.reason and verdict.signature == "segfault:library"


def test_a_segfault_in_nccl_on_a_named_node_names_it_a_suspect():
    # the tune row is labelled requeue: a crash in NCCL's reduce-scatter that a
    # restart gets past; the node is excluded only once the crash stays with it
    verdict = attribute(frames(UCX_SEGV, det(UCX_SEGV[0], "segfault", host="ib-vm-61")))
    assert (verdict.blame, verdict.action, verdict.nodes) == ("unknown", "requeue", ())
    assert verdict.suspects == ("ib-vm-61",) and verdict.signature == "segfault:library"
    assert "pncclReduceScatter" in verdict.reason


def test_a_library_segfault_that_stays_with_its_node_excludes_it():
    first = PriorAttempt(("ib-vm-61", "ib-vm-62"), attribute(
        frames(UCX_SEGV, det(UCX_SEGV[0], "segfault", host="ib-vm-61"))), 0)
    now = attribute(frames(UCX_SEGV, det(UCX_SEGV[0], "segfault", host="ib-vm-61")))
    again = across_attempts(now, ("ib-vm-61", "ib-vm-70"), (first,))
    assert (again.action, again.nodes) == ("requeue_exclude", ("ib-vm-61",))


def test_the_signal_handlers_frames_are_not_where_it_crashed():
    # libucs's handler and libc's trampoline come first: the crash is in libcuda,
    # which the job's own calls reach (the row's thread: a driver regression that
    # every retry on that driver hits)
    verdict = attribute(frames(UCX_SEGV_LIBCUDA, det(UCX_SEGV_LIBCUDA[0], "segfault")))
    assert "libcuda.so.1" in verdict.reason
    assert (verdict.action, verdict.signature) == ("stop", "segfault:driver")


def test_the_kernels_fault_report_names_the_object():
    # the two kernel lines are the examples of signals.toml's kernel segfault rules,
    # from a public llama.cpp issue and leptonai/gpud's NCCL kmsg component
    in_nccl = ("[Thu Oct 10 03:06:53 2024] pt_main_thread[2536443]: segfault at 7f797fe00000 ip "
               "00007f7c7ac69996 sp 00007f7c12fd7c30 error 4 in libnccl.so.2[7f7c7ac00000+d3d3000]")
    in_code = ("[152970.213392] llama-parallel[398992]: segfault at 8 ip 00007f8fb6e5bde0 sp "
               "00007ffd3eda32e8 error 4 in libllama.so[7f8fb6e2c000+103000] likely on CPU 10 "
               "(core 20, socket 0)")
    assert attribute([det(in_nccl, "segfault")]).action == "requeue"
    in_driver = ("[Sat Aug 23 11:05:44 2025] llama-server[383019]: segfault at 20e403fd8 ip "
                 "00007fe8ef318637 sp 00007fe84ee2ff80 error 4 in libcuda.so.575.64.05[518637,"
                 "7fe8eefc5000+e97000] likely on CPU 114 (core 50, socket 0)")
    assert attribute([det(in_driver, "segfault")]).action == "stop"
    verdict = attribute([det(in_code, "segfault")])
    assert (verdict.action, verdict.blame, verdict.signature) == ("stop", "application",
                                                                  "segfault:code")


def test_a_segfault_with_no_backtrace_is_still_a_bug():
    verdict = attribute([det(SHELL_SEGV, "segfault")])
    assert (verdict.action, verdict.blame, verdict.signature) == ("stop", "application",
                                                                  "segfault")


# -- 3. CUDA errors that may be the GPU --------------------------------------------

def test_an_illegal_address_alone_is_requeued_not_stopped():
    verdict = attribute([det(ILLEGAL_ADDRESS, "cuda_error", "cause", "stop")])
    assert (verdict.action, verdict.blame, verdict.signature) == ("requeue", "unknown",
                                                                  "cuda:illegal_address")
    assert decide(verdict).action == "requeue"


def test_a_cuda_error_with_a_gpu_fault_on_its_node_blames_the_node():
    found = [det(LAUNCH_FAILURE, "cuda_error", "cause", "requeue", line=1, host="g1"),
             det(XID79, "gpu_hardware", "root", "requeue", line=2, host="g1",
                 pci="0000:02:00", rule="kernel.xid")]
    verdict = attribute(found)
    assert (verdict.blame, verdict.category, verdict.action) == ("node", "gpu_hardware",
                                                                 "requeue_exclude")
    assert verdict.nodes == ("g1",) and verdict.gpus == ("0000:02:00",)


def test_a_gpu_fault_on_another_node_or_caused_by_the_code_is_not_node_evidence():
    elsewhere = [det(LAUNCH_FAILURE, "cuda_error", "cause", "requeue", line=1, host="g1"),
                 det(XID79, "gpu_hardware", "root", "requeue", line=2, host="g2")]
    assert attribute(elsewhere).blame == "unknown"
    by_code = [det(ILLEGAL_ADDRESS, "cuda_error", "cause", "stop", line=1),
               det(XID13, "gpu_hardware", "root", "stop", line=2, pci="0000:cb:00")]
    assert (attribute(by_code).blame, attribute(by_code).action) == ("unknown", "requeue")


def test_a_node_event_xid_from_the_hooks_names_the_gpu():
    xid = det(XID79, "gpu_hardware", "cause", "requeue", host="g1", origin="system",
              xid=79, pci="0000:02:00", rule="xid", source="hook:g1/epilog")
    verdict = attribute([det(ILLEGAL_ADDRESS, "cuda_error", "cause", "stop")],
                        AttributionContext(nodes=("g1", "g2"), node_events=(xid,)))
    assert (verdict.blame, verdict.nodes, verdict.action) == ("node", ("g1",), "requeue_exclude")


# -- 4. across attempts -------------------------------------------------------------

def _prior(verdict_lines: list[Detection], nodes: tuple[str, ...], attempt: int) -> PriorAttempt:
    return PriorAttempt(nodes, attribute(verdict_lines), attempt)


def test_a_cuda_error_that_follows_the_job_onto_fresh_nodes_is_the_code():
    first = _prior([det(ILLEGAL_ADDRESS, "cuda_error")], ("n1", "n2"), 0)
    now = attribute([det(ILLEGAL_ADDRESS, "cuda_error")])
    d = decide(now, history=History(restarts=1, nodes=("n3", "n4"), previous=(first,)))
    assert (d.action, d.rule) == ("stop", "recurring")
    assert "follows the job" in d.reason and "attempt 0" in d.reason


def test_a_cuda_error_that_stays_with_one_node_blames_that_node():
    first = _prior([det(LAUNCH_FAILURE, "cuda_error", action="requeue")], ("n1", "n2"), 0)
    now = attribute([det(LAUNCH_FAILURE, "cuda_error", action="requeue")])
    d = decide(now, history=History(restarts=1, nodes=("n2", "n5"), previous=(first,)))
    assert (d.action, d.blamed) == ("requeue_exclude", ("n2",))
    assert "stays with that node" in d.reason


# ho-lightning20434-broadcast-seq1-timeout-after-init
FIRST_BROADCAST = ("[rank3]:[E1119 13:21:12.512781555 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog "
                   "caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, "
                   "NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800000 milliseconds "
                   "before timing out.")


def _watchdog(text: str) -> Detection:
    return det(text, "nccl_timeout_hang", role="symptom", action="requeue",
               rule="nccl.watchdog_timeout")


def test_a_hang_at_the_same_collective_as_the_attempt_before_is_the_run():
    first = _prior([_watchdog(WATCHDOG)], ("n1", "n2"), 0)
    assert first.verdict.signature == "hang:ALLREDUCE:808:9801523"
    now = attribute([_watchdog(WATCHDOG)])
    # the same nodes or others: a fault strikes wherever the run is, not at one collective
    for nodes in (("n1", "n2"), ("n3", "n4")):
        d = decide(now, history=History(restarts=1, nodes=nodes, previous=(first,)))
        assert (d.action, d.rule) == ("stop", "recurring")
        assert "same collective (ALLREDUCE number 808)" in d.reason and "attempt 0" in d.reason


def test_a_hang_elsewhere_in_the_run_is_retried():
    first = _prior([_watchdog(WATCHDOG)], ("n1", "n2"), 0)
    later = WATCHDOG.replace("SeqNum=808", "SeqNum=1808")
    d = decide(attribute([_watchdog(later)]),
               history=History(restarts=1, nodes=("n3", "n4"), previous=(first,)))
    assert d.action == "requeue"
    # nor a timeout that names no collective
    bare = attribute([_watchdog(POST_FIT_TIMEOUT)])
    assert bare.signature == ""
    assert across_attempts(bare, ("n3", "n4"), (_prior([_watchdog(POST_FIT_TIMEOUT)],
                                                       ("n1", "n2"), 0),)).action == "requeue"


def test_a_hang_at_the_first_collective_stops_only_on_fresh_nodes():
    # where a bad node or link first shows: the same first broadcast on a node
    # the attempts shared is not yet the run
    first = _prior([_watchdog(FIRST_BROADCAST)], ("n1", "n2"), 0)
    now = attribute([_watchdog(FIRST_BROADCAST)])
    shared = across_attempts(now, ("n2", "n3"), (first,))
    assert shared.action != "stop"
    fresh = across_attempts(now, ("n3", "n4"), (first,))
    assert (fresh.action, fresh.blame) == ("stop", "application")


# bloom13b-dataloader-shm-bus-error (dev_failures.jsonl)
SHM_BUS_ERROR = ("ERROR: Unexpected bus error encountered in worker. This might be caused "
                 "by insufficient shared memory (shm).")


def test_dataloader_shared_memory_runs_out_once_retried_twice_stopped():
    first = attribute(SCANNER.scan_lines([SHM_BUS_ERROR], source="job.log"))
    assert (first.action, first.signature) == ("requeue", "shm")
    prior = PriorAttempt(("n1",), first, 0)
    d = decide(first, history=History(restarts=1, nodes=("n2",), previous=(prior,)))
    assert (d.action, d.rule) == ("stop", "recurring")
    assert "shared memory in attempt 0 too" in d.reason
    # after another failure, it is still retried
    other = PriorAttempt(("n1",), attribute([det(ILLEGAL_ADDRESS, "cuda_error")]), 0)
    assert across_attempts(first, ("n2",), (other,)).action == "requeue"


# rpg_open_remode#9 (cuda.driver_too_old's example)
DRIVER_TOO_OLD = "ERROR: cudaGetDeviceCount CUDA driver version is insufficient for CUDA runtime version"


def test_a_driver_mismatch_excludes_the_node_and_stops_when_it_follows_the_job():
    first = attribute(SCANNER.scan_lines([DRIVER_TOO_OLD], source="job.log"),
                      AttributionContext(nodes=("n1",)))
    assert (first.action, first.nodes, first.signature) == \
        ("requeue_exclude", ("n1",), "cuda:driver")
    d = decide(first, history=History(restarts=1, nodes=("n2",),
                                      previous=(PriorAttempt(("n1",), first, 0),)))
    assert (d.action, d.rule) == ("stop", "recurring") and "follows the job" in d.reason


def test_on_the_same_nodes_the_host_that_printed_it_both_times_is_blamed():
    first = _prior([det(LAUNCH_FAILURE, "cuda_error", action="requeue", host="n2")],
                   ("n1", "n2"), 0)
    now = attribute([det(LAUNCH_FAILURE, "cuda_error", action="requeue", host="n2")])
    assert across_attempts(now, ("n1", "n2"), (first,)).nodes == ("n2",)
    anywhere = attribute([det(LAUNCH_FAILURE, "cuda_error", action="requeue")])
    assert across_attempts(anywhere, ("n1", "n2"), (first,)).action == "requeue"


def test_a_library_segfault_that_follows_the_job_stops_too():
    first = PriorAttempt(("n1",), attribute(frames(OMPI_SEGV, det(OMPI_SEGV[0], "segfault"))), 0)
    now = attribute(frames(OMPI_SEGV, det(OMPI_SEGV[0], "segfault")))
    assert across_attempts(now, ("n7",), (first,)).action == "stop"


def test_an_interconnect_peer_named_twice_is_excluded():
    # a peer completion error asking only to requeue (an intermittent status 12)
    peer = det(IB_PEER, "interconnect", "cause", "requeue", host="n5")
    first = PriorAttempt(("n4", "n5"), attribute([peer]), 0)
    assert first.verdict.suspects == ("n5",) and first.verdict.nodes == ()
    d = decide(attribute([peer]), history=History(restarts=1, nodes=("n5", "n6"),
                                                 previous=(first,)))
    assert (d.action, d.blamed) == ("requeue_exclude", ("n5",))
    assert "named by the failure of attempt 0 too" in d.reason


def test_an_uncorrectable_ecc_error_never_counts_as_the_code():
    ecc = ("RuntimeError: CUDA error: uncorrectable ECC error encountered")  # jade194-*
    first = PriorAttempt(("n1",), attribute([det(ecc, "cuda_error", action="requeue_exclude")]), 0)
    now = attribute([det(ecc, "cuda_error", action="requeue_exclude")])
    assert across_attempts(now, ("n2",), (first,)).action == "requeue_exclude"


# -- 5. a timeout after the work was done -------------------------------------------

def test_a_watchdog_after_the_last_epoch_means_nothing_to_redo():
    found = [det(FIT_DONE, "application", "exit", "none", severity="info", line=1),
             det(POST_FIT_TIMEOUT, "nccl_timeout_hang", "symptom", "requeue", line=2)]
    verdict = attribute(found)
    assert (verdict.category, verdict.action, verdict.signature) == ("nccl_timeout_hang", "none",
                                                                     "done")
    d = decide(verdict, state="FAILED")
    assert (d.action, d.rule) == ("none", "work_done") and not d.acts


def test_a_completion_after_the_timeout_does_not_count():
    found = [det(POST_FIT_TIMEOUT, "nccl_timeout_hang", "symptom", "requeue", line=1),
             det(FIT_DONE, "application", "exit", "none", severity="info", line=2)]
    assert attribute(found).action == "requeue"


# -- 6. store and rendezvous --------------------------------------------------------

def test_a_store_failure_is_a_setup_timeout_that_excludes_no_node():
    found = [det(STORE_RECV, "interconnect", "symptom", "requeue_exclude",
                 host="sglang-0.default.pod.transwarp.local")]
    verdict = attribute(found)
    assert (verdict.category, verdict.action, verdict.nodes) == ("nccl_timeout_hang", "requeue",
                                                                 ())
    assert verdict.suspects == ()          # not one of the job's nodes (none known)
    inside = attribute(found, AttributionContext(
        nodes=("sglang-0.default.pod.transwarp.local", "sglang-0-1")))
    assert inside.suspects == ("sglang-0.default.pod.transwarp.local",) and inside.nodes == ()


def test_a_store_failure_even_as_a_cause_does_not_exclude_its_host():
    found = [det(STORE_RECV, "interconnect", "cause", "requeue_exclude", host="n1")]
    verdict = attribute(found, AttributionContext(nodes=("n1", "n2")))
    assert (verdict.action, verdict.nodes, verdict.suspects) == ("requeue", (), ("n1",))


# -- 7. filesystem ------------------------------------------------------------------

def test_a_full_disk_stops_with_a_clear_reason():
    verdict = attribute([det(ENOSPC, "system_software", "cause", "stop")])
    assert verdict.action == "stop" and "the filesystem is full" in verdict.reason
    d = decide(verdict)
    assert d.action == "stop" and "No space left on device" in d.reason
    assert d.reason.startswith("retrying cannot help")
    # ho-hostg7-lustre-disk-quota-exceeded
    quota = attribute([det("OSError: [Errno 122] Disk quota exceeded: 'out/intermediate.ntw'",
                           "system_software", "cause", "requeue")])
    assert quota.action == "stop" and "over its quota" in quota.reason


def test_a_full_shm_outweighs_the_requeue_of_its_echo():
    found = [det(SHM_ENOSPC[0], "system_software", "cause", "stop", line=1),
             det(SHM_ENOSPC[1], "system_software", "cause", "requeue", line=2)]
    assert attribute(found).action == "stop"


def test_a_write_error_without_a_full_disk_is_retried_then_stopped():
    verdict = attribute([det(WRITE_EIO, "system_software", "cause", "stop")])
    assert (verdict.action, verdict.signature) == ("requeue", "io:write")
    assert decide(verdict).action == "requeue"
    again = decide(verdict, history=History(restarts=1, nodes=("n2",), previous=(
        PriorAttempt(("n1",), verdict, 0),)))
    assert (again.action, again.rule) == ("stop", "recurring")
    assert "a full disk, a quota or a filesystem fault" in again.reason


def test_a_verdict_read_across_no_attempts_is_unchanged():
    verdict = Verdict("unknown", "cuda_error", "requeue", 0.8, signature="cuda:launch_failure")
    assert across_attempts(verdict, ("n1",), ()) is verdict


# r6-mooncake117-erdma-qp-catastrophic-peer-nic (kvcache-ai/Mooncake#117): a
# transfer engine's RDMA write fails, then the HCA raises the queue pair's own
# fatal async event (libibverbs' IBV_EVENT_QP_FATAL text)
QP_FATAL = ["E0222 20:07:21.119704 2179433 worker_pool.cpp:291] Worker: Process failed for "
            "slice (opcode: 0, source_addr: 0x7f5cfc000000, length: 65536, dest_addr: "
            "140123979120640, local_nic: erdma_0, peer_nic: 10.0.0.41:7712@erdma_0, dest_rkey: "
            "39908608, retry_cnt: 0): general error",
            "W0222 20:07:21.119717 2179435 worker_pool.cpp:399] Worker: Received context async "
            "event local work queue catastrophic error for context erdma_0"]


def test_a_queue_pairs_fatal_event_is_the_transport_requeued_without_blaming_the_node():
    found = SCANNER.scan_lines(QP_FATAL)
    assert [d.rule for d in found] == ["ib.queue_fatal_event"]
    verdict = attribute(found)
    assert (verdict.category, verdict.action) == ("interconnect", "requeue")
    decision = decide(verdict, state="FAILED")
    assert decision.action == "requeue" and decision.exclude == () and decision.drain == ()
