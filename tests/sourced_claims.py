"""The sentences no CPU can test, each with the source that says it.

A sentence about torch, NCCL, SLURM or a paper earns its place by a test of exactly the condition
it states (``tests/test_torch_claims.py`` and each lesson's tests). Where only a GPU, NCCL or a real
cluster could run that test, it earns it here instead: the words of the sentence as the lesson
prints them, and where the behaviour is written (a file and a function at a named version, or a
paper's section). ``tests/test_sourced_claims.py`` checks that each sentence is still in its
lesson's text and, for torch, that the named function is still defined in the named file of the
torch this course runs on, so a rename or a rewrite of the text makes somebody read the source
again.

``sentence``: a few words of the lesson's text, enough to find it (whitespace and line breaks do
not matter). ``source``: ``torch:<path under torch/>:<function or Class.method>`` for torch;
anything else (``slurm:``, ``nccl:``, ``paper:``, ``release:`` for a release note or the pull
request that made a change, ``repo:`` for a file of another project at a named commit) is a
reference checked by a reader, not a test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sourced:
    lesson: str      # the lesson folder whose README holds the sentence
    sentence: str    # a few words of it, as printed (whitespace-insensitive)
    source: str      # torch:<path>:<qualified name>, or slurm:/nccl:/paper:/release:/repo: ...
    version: str     # the version that was read: "torch 2.14.1", "Slurm 24.05", "arXiv v2"
    says: str        # what that source says, in one line


CLAIMS: list[Sourced] = [
    Sourced("01_data_parallel", "torch 1.9 (2021) added torch.distributed.run, and torch 1.10 gave "
            "it the torchrun command",
            "release: pytorch/pytorch pull request 64049 (\"Introduce the torchrun entrypoint\", "
            "merged August 2021, in 1.10); torch 1.9.0's release notes (torch.distributed.run, "
            "the elastic launcher, June 2021)",
            "torch 1.9.0 and 1.10.0 release notes",
            "torchrun is an entry point for python -m torch.distributed.run, new in 1.10; "
            "torch.distributed.run came with 1.9"),
    Sourced("06_tensor_parallel", "but only for random operators on DTensors",
            "torch:distributed/tensor/_dispatch.py:OpDispatcher._dispatch_get_local_results_slow_path",
            "torch 2.14.1",
            "the offset-based RNG tracker is created and entered only while DTensor dispatches an "
            "operator on DTensor arguments; plain local tensors never reach it"),
    Sourced("08_measure_and_choose", "for a ring, a tree or any algorithm of sends and receives",
            "nccl: NVIDIA/nccl-tests doc/PERFORMANCE.md, \"Bus bandwidth\" (AllReduce) and "
            "\"Summary\"",
            "nccl-tests master, commit 03a204a",
            "busbw = algbw x 2(n-1)/n for AllReduce, (n-1)/n for ReduceScatter and AllGather, 1 "
            "for Broadcast; \"independent of the algorithm used (ring, tree, or other) as long "
            "as they use point-to-point operations (send/receive)\""),
    Sourced("08_measure_and_choose", "set to None (the default, and train_amp.py's), each step's "
            "new gradients are still copied into the buckets",
            "torch:nn/parallel/distributed.py:DistributedDataParallel",
            "torch 2.14.1",
            "the docstring of batched_grad_copy: with optimizer.zero_grad(set_to_none=True) (the "
            "default) \"gradient_as_bucket_view alone cannot avoid copies because the bucket "
            "view alias is destroyed every iteration\" (tests/test_torch_claims.py counts them)"),
    Sourced("07_pipeline_parallel", "runs the pair in turn unless a function is registered for "
            "OVERLAP_F_B",
            "torch:distributed/pipelining/schedules.py:_PipelineScheduleRuntime._step_microbatches",
            "torch 2.14.1",
            "an action whose type is in _comp_type_to_function_map (filled by "
            "register_custom_function) runs that function; otherwise an OVERLAP_F_B action runs "
            "`for sub_a in action.sub_actions: _perform_action(sub_a)`, its forward and backward "
            "in turn; ScheduleDualPipeV builds OVERLAP_F_B actions"),
    Sourced("07_pipeline_parallel", "DeepSeek's DualPipe cut in half onto the same V",
            "paper: deepseek-ai/DualPipe README.md (DualPipe, from the DeepSeek-V3 Technical "
            "Report, arXiv 2412.19437, section 3.2.1), its \"Schedules\" and \"DualPipeV\" parts",
            "DualPipe README, commit 89f5de1 and the later version with DualPipeV",
            "DualPipe \"achieves full overlap of forward and backward computation-communication "
            "phases\"; in its schedule \"two cells enclosed by a shared black border have "
            "mutually overlapped computation and communication\"; \"DualPipeV is a concise "
            "V-shape schedule derived from DualPipe using a 'cut-in-half' procedure, introduced "
            "by Sea AI Lab\""),
    Sourced("05_sharded_data_parallel", "On a GPU FSDP2 runs its all-gathers on a stream of "
            "their own",
            "torch:distributed/fsdp/_fully_shard/_fsdp_param_group.py:"
            "FSDPCommContext.get_all_gather_streams",
            "torch 2.14.1 (the same in 2.11)",
            "in the forward and before the backward, unless unshard_async_op is set, the "
            "all-gather's copy-in and the all-gather run on all_gather_copy_in_stream and "
            "all_gather_stream, not the current (computation's) stream"),
    Sourced("05_sharded_data_parallel", "FSDPParam.all_gather_inputs copies a group's shards to "
            "the GPU",
            "torch:distributed/fsdp/_fully_shard/_fsdp_param.py:FSDPParam.all_gather_inputs",
            "torch 2.14.1",
            "with offload_to_cpu, the sharded local tensor is moved .to(self.device, "
            "non_blocking=True) before it goes into the all-gather"),
    Sourced("05_sharded_data_parallel", "foreach_reduce copies only this rank's shard of them to "
            "the CPU",
            "torch:distributed/fsdp/_fully_shard/_fsdp_collectives.py:foreach_reduce",
            "torch 2.14.1",
            "after the reduce-scatter, with fsdp_param.offload_to_cpu, new_sharded_grad (this "
            "rank's shard) is moved .to(torch.device(\"cpu\")); the whole gradient stays on the "
            "device"),
    Sourced("11_mixture_of_experts", "Switch Transformer (k = 1) weighs its expert by p itself",
            "paper: Fedus, Zoph, Shazeer, Switch Transformers (arXiv 2101.03961), section 2.1, "
            "equations 1-2 and \"Switch Routing\"",
            "arXiv 2101.03961",
            "p_i(x) is the softmax of the router's logits; the layer's output is "
            "y = sum over the selected T of p_i(x) E_i(x), and Switch routes to a single expert, "
            "so y = p_i(x) E_i(x) with the raw probability"),
    Sourced("11_mixture_of_experts", "GShard (top-2) divides its two gates by their sum",
            "paper: Lepikhin et al., GShard (arXiv 2006.16668), section 2.2, Algorithm 1 "
            "(group-level top-2 gating)",
            "arXiv 2006.16668",
            "Algorithm 1, line 6: g1 <- g1 / (g1 + g2) (\"normalized g1\"); line 16, in the "
            "second loop: g2 <- g2 / (g1 + g2) (\"normalized g2\")"),
    Sourced("11_mixture_of_experts", "Mixtral takes a softmax over the k chosen logits",
            "paper: Jiang et al., Mixtral of Experts (arXiv 2401.04088), section 2.1",
            "arXiv 2401.04088",
            "G(x) := Softmax(TopK(x W_g)), TopK setting every logit outside the top k to -inf; "
            "K = 2 of 8 experts"),
    Sourced("11_mixture_of_experts", "DeepSeek-V3 scores with a sigmoid, whose values need not "
            "sum to 1, and normalises among the selected experts",
            "paper: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), section "
            "2.1.2, equations 13-15",
            "arXiv 2412.19437",
            "s_i,t = Sigmoid(u_t^T e_i); g'_i,t = s_i,t for the top K_r, else 0; "
            "g_i,t = g'_i,t / sum_j g'_j,t: \"applies a normalization among all selected "
            "affinity scores to produce the gating values\""),
    Sourced("10_long_sequences", "SDPA's fused kernels keep each block's output and log-sum-exp "
            "instead",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:"
            "_scaled_dot_product_ring_flash_attention_backward",
            "torch 2.14.1",
            "the CUDA kernels' backwards (flash, memory-efficient, cuDNN, as context parallel "
            "calls them per block) take query, key, value, out and logsumexp (and the dropout "
            "RNG state), no probabilities; on the CPU tests/test_torch_claims.py counts what "
            "the fused kernel saves"),
    Sourced("01_data_parallel", "The batch is still moved to device_ids[0] (in one chunk) and "
            "the module is called on it directly; its output is not gathered to output_device",
            "torch:nn/parallel/data_parallel.py:DataParallel.forward",
            "torch 2.14.1",
            "forward scatters the inputs over device_ids before it looks at their number; with "
            "one id it returns self.module(*inputs[0]) and never calls gather"),
    Sourced("03_ddp", "NCCL at the first collective, unless given a device_id",
            "torch:distributed/distributed_c10d.py:init_process_group",
            "torch 2.14.1",
            "device_id's docstring: given it, the backend is bound to the device and \"may "
            "make use of it for eager initialization\"; without it NCCL creates its "
            "communicator at the first collective"),
    Sourced("00_single_gpu", "torch 2.11 and newer no longer ask (each stream has its own "
            "cuBLAS workspace; pull request 161749, 2025)",
            "release: pytorch/pytorch pull request 161749 (\"update cuBLAS determinism docs, "
            "remove workspace requirement checks\", 2025); torch 2.14.1's libtorch_cuda.so no "
            "longer holds the old error (\"...because it uses CuBLAS and you have CUDA >= "
            "10.2\") and use_deterministic_algorithms's docstring no longer names the variable; "
            "nor does 2.11.0's",
            "torch 2.11.0 and 2.14.1",
            "torch allocates a cuBLAS workspace per handle and stream (pull request 85447), "
            "which cuBLAS documents as enough for reproducible results"),
    Sourced("09_survive_and_scale_out", "does not forward it: kills the step with SIGKILL",
            "slurm:src/srun/srun_job.c:_srun_signal_mgr (24.05); src/srun/signals.c:"
            "_forward_signal (26.05)",
            "Slurm 24.05.0 and 26.05.3",
            "case SIGQUIT, SIGTERM, SIGHUP: info(\"forcing job termination\"); "
            "launch_g_fwd_signal(SIGKILL); SIGINT prints the state (a second within 1 s sends "
            "SIGINT, then SIGKILL); every other signal: launch_g_fwd_signal(sig)"),
    Sourced("09_survive_and_scale_out", "forwards it to every process of the step, on every node",
            "slurm:src/srun/launch.c:launch_g_fwd_signal -> slurm_step_launch_fwd_signal "
            "(REQUEST_SIGNAL_TASKS); src/slurmd/slurmstepd/req.c:_handle_signal_container",
            "Slurm 24.05.0",
            "slurmstepd delivers a step's signal with proctrack_g_signal(step->cont_id, sig): "
            "every process of the step's container (cgroup), not only the task srun started"),
    Sourced("09_survive_and_scale_out", "and its ranks are killed with the step",
            "slurm:src/slurmd/slurmstepd/mgr.c:job_manager",
            "Slurm 24.05.0",
            "after _wait_for_all_tasks, proctrack_g_signal(step->cont_id, SIGKILL): what the "
            "step's tasks left running is killed"),
    Sourced("09_survive_and_scale_out", "--signal=B:USR1@90: to the batch shell alone",
            "slurm:doc/man/man1/sbatch.1 (--signal); src/slurmctld/job_mgr.c:"
            "send_job_warn_signal; src/slurmd/slurmstepd/req.c:_handle_signal_container",
            "Slurm 24.05.0",
            "\"Use the B: option to signal only the batch shell\"; without B: the flags become "
            "KILL_STEPS_ONLY; with KILL_JOB_BATCH slurmstepd calls kill(step->pgid, sig), the "
            "batch shell's own process, not killpg"),
    Sourced("09_survive_and_scale_out", "SLURM may send it up to a minute earlier than asked",
            "slurm:doc/man/man1/sbatch.1 (--signal); src/slurmctld/job_mgr.c:"
            "send_job_warn_signal",
            "Slurm 24.05.0",
            "\"the signal may be sent up to 60 seconds earlier than specified\": sent once "
            "warn_time + PERIODIC_TIMEOUT + now >= end_time"),
    Sourced("09_survive_and_scale_out", "preemption: to every process of the job's steps, not "
            "through srun",
            "slurm:src/interfaces/preempt.c:_job_check_grace_internal; src/slurmctld/"
            "job_mgr.c:_signal_job",
            "Slurm 24.05.0",
            "with a grace time: job_signal(job_ptr, SIGCONT, 0, ...), then SIGTERM with flags "
            "0, which _signal_job sends as KILL_STEPS_ONLY: every step but the batch script's "
            "(where srun runs); end_time is set to now + GraceTime. Unless the cluster sets "
            "PreemptParameters=send_user_signal and the job has a --signal: then "
            "send_job_warn_signal sends the job's own signal instead (with B:, to the batch "
            "shell alone)"),
    Sourced("09_survive_and_scale_out", "the srun of Slurm 22.05 and 23.02 does not read "
            "SLURM_CPUS_PER_TASK, and then binds each task to one CPU",
            "slurm:RELEASE_NOTES (22.05: \"srun will no longer read in SLURM_CPUS_PER_TASK\"; "
            "23.11 reads it again); src/srun/libsrun/opt.c env_vars (SRUN_CPUS_PER_TASK, 22.05); "
            "src/srun/libsrun/launch.c:_create_job_step_create_request",
            "Slurm 22.05.0 and 23.11.0",
            "22.05 maps only SRUN_CPUS_PER_TASK to -c; without -c, step_req->cpu_count = "
            "opt_local->ntasks and the step is whole (SSF_WHOLE) but each task is bound with "
            "cpus_per_task = 1; with -c, cpu_count = ntasks * cpus_per_task and "
            "SLURM_CPUS_PER_TASK is set for the task (src/common/env.c:setup_env)"),
    Sourced("09_survive_and_scale_out", "by default the agent of GROUP_RANK 0 hosts it",
            "torch:distributed/elastic/rendezvous/dynamic_rendezvous.py:"
            "DynamicRendezvousHandler.next_rendezvous",
            "torch 2.14.1",
            "unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE is 1, the node of rendezvous rank 0 "
            "creates _shared_tcp_store_server and publishes its port as the workers' "
            "MASTER_PORT; with it, RendezvousStoreInfo.build only picks a free port, and "
            "torch.distributed.rendezvous._create_c10d_store makes rank 0's worker the server "
            "(the lesson's test checks that side)"),
    Sourced("11_mixture_of_experts", "all_to_all_single_autograd, now a pass-through to it",
            "torch:distributed/_functional_collectives.py:all_to_all_single_autograd",
            "torch 2.14.1",
            "its body calls all_to_all_single: \"The base all_to_all_single now has autograd "
            "support, so we can just call it\""),
    Sourced("11_mixture_of_experts", "torchtitan's token dispatcher calls all_to_all_single itself",
            "repo: pytorch/torchtitan torchtitan/models/common/token_dispatcher.py (commit "
            "78fc8ae32, pull request 3142, June 2026, replaced all_to_all_single_autograd)",
            "torchtitan main, August 2026",
            "imports all_to_all_single from torch.distributed._functional_collectives for the "
            "dispatch and the combine"),
    Sourced("07_pipeline_parallel", "NCCL documents each send and receive as blocking on the GPU "
            "until it is matched",
            "nccl: NCCL User Guide, Point-to-point communication (ncclSend, ncclRecv) and "
            "Group Calls",
            "NCCL 2.28 documentation",
            "ncclSend and ncclRecv are blocking for the GPU; operations that need to progress "
            "concurrently must be fused within ncclGroupStart()/ncclGroupEnd()"),
    Sourced("07_pipeline_parallel", "torch runs the stage's forward once more on the first step "
            "to learn them, 2.14 on micro-batch 0 itself, 2.11 on zeros of its shape",
            "torch:distributed/pipelining/stage.py:PipelineStage._forward_metadata_inference",
            "torch 2.14.1 (and 2.11.0's PipelineStage._shape_inference)",
            "in dynamic mode the stage runs its submodule on the first micro-batch to infer what "
            "it sends (a forward pre-hook counted 5 forwards at step 0 and 4 later, m = 4, "
            "2 gloo ranks); 2.11 runs it under no_grad on zeros_like of micro-batch 0"),
    Sourced("10_long_sequences", "in the forward and again in the backward, so it does hold them "
            "all",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:"
            "_templated_ring_attention_backward",
            "torch 2.14.1",
            "the backward makes kv_rotater with the configured method (all-gather by default) "
            "and dkv_rotater with _RotateMethod.ALL_TO_ALL always: keys and values gathered "
            "again, their gradients passed to the next rank"),
    Sourced("10_long_sequences", "Llama 3 all-gathers the keys and values",
            "paper: Llama Team, The Llama 3 Herd of Models (arXiv 2407.21783), section 3.3.2, "
            "context parallelism",
            "arXiv 2407.21783",
            "an all-gather based context parallelism: keys and values all-gathered, then "
            "attention for the local queries; the sequence cut into 2 x CP chunks, rank i "
            "taking the i-th and the (2 x CP - 1 - i)-th"),
    Sourced("09_survive_and_scale_out", "with ProctrackType=proctrack/cgroup, the usual setting",
            "slurm: src/slurmd/slurmstepd/req.c, _handle_signal_container (proctrack_g_signal on "
            "the step's container); src/plugins/proctrack/pgid/proctrack_pgid.c, "
            "proctrack_p_signal (killpg of the task's process group)",
            "Slurm 24.05.0",
            "cgroup tracking signals every descendant of the task; pgid tracking only its "
            "process group, which torchrun's workers leave (start_new_session)"),
    Sourced("09_survive_and_scale_out", "which waits about two minutes in the queue",
            "slurm: src/slurmctld/job_mgr.c, the requeue of a running job (begin_time = now + "
            "cred_expiration() + 1)",
            "Slurm 24.05.0",
            "a job requeued while it runs may not start again before its credentials expire, "
            "120 s by default"),
    Sourced("09_survive_and_scale_out", "--open-mode=append keeps the first run's log",
            "slurm: src/slurmd/slurmstepd/io.c, io_get_file_flags",
            "Slurm 24.05.0",
            "output files are opened with O_TRUNC unless --open-mode=append or JobFileAppend=1"),
    Sourced("09_survive_and_scale_out", "if its partition gives a GraceTime",
            "slurm: src/slurmctld/preempt.c and job_mgr.c, _job_check_grace_internal "
            "(KILL_STEPS_ONLY); slurm.conf's GraceTime",
            "Slurm 24.05.0",
            "with a grace time the steps get SIGTERM and the job may end by itself and be "
            "requeued; without one it is terminated at once, KillWait then SIGKILL"),
    Sourced("04_pitfalls", "10 with NCCL when the backend is \"nccl\", named or taken from a CUDA "
            "device_id",
            "torch:distributed/distributed_c10d.py:init_process_group",
            "torch 2.14.1",
            "with no backend but a device_id, the backend comes from default_device_backend_map "
            "(cuda: nccl) before timeout = _get_default_timeout(backend), which gives 10 minutes "
            "only for backend == \"nccl\""),
    Sourced("10_long_sequences", "can be re-split by heads for the length of attention",
            "paper: Jacobs et al., DeepSpeed Ulysses: System Optimizations for Enabling Training "
            "of Extreme Long Sequence Transformer Models (arXiv 2309.14509), section 3 (system "
            "design) and its figure 2",
            "arXiv 2309.14509",
            "the input is partitioned along the sequence; before attention an all-to-all on q, "
            "k and v gives each GPU the full sequence for a non-overlapping subset of the heads; "
            "after attention a second all-to-all re-partitions the output along the sequence"),
    Sourced("10_long_sequences", "its volume stays constant when the sequence and the devices "
            "grow together",
            "paper: Jacobs et al., DeepSpeed Ulysses (arXiv 2309.14509), abstract and section 3 "
            "(communication analysis)",
            "arXiv 2309.14509",
            "\"DeepSpeed-Ulysses maintains constant communication volume when sequence length "
            "and compute devices are increased proportionally\"; the all-to-alls carry 3Nh "
            "(q, k, v) and Nh (output), 4Nh/P per link"),
    Sourced("10_long_sequences", "runs Ulysses inside groups of consecutive ranks",
            "paper: Fang and Zhao, USP: A Unified Sequence Parallelism Approach for Long Context "
            "Generative AI (arXiv 2405.07719); repo: feifeibear/long-context-attention "
            "yunchang/globals.py, set_seq_parallel_pg (commit 56118e0)",
            "arXiv 2405.07719; yunchang commit 56118e0",
            "sp degree = ulysses degree x ring degree; with use_ulysses_low=True (the default) "
            "each Ulysses group is a run of consecutive ranks and each ring takes the ranks at "
            "the same place in every group"),
    Sourced("10_long_sequences", "reports the hybrid fastest on 8 PCIe GPUs",
            "repo: feifeibear/long-context-attention README.md, \"Benchmark\" (\"Some "
            "Conclusions\" 1 and 4) (commit 56118e0)",
            "yunchang commit 56118e0",
            "\"The All-to-All communication of Ulysses is highly efficient within a single "
            "machine\"; \"on an 8-GPU L20 setup, the optimal performance is achieved when "
            "ulysess_degree is set to 2 and ring_degree is set to 4\" (an 8xL20 PCIe machine)"),
    Sourced("10_long_sequences", "Its all-to-alls are fast inside a node",
            "repo: feifeibear/long-context-attention README.md, \"Some Conclusions\" 1 and "
            "\"Why not apply Ulysses and Ring Attention Individually?\" (commit 56118e0)",
            "yunchang commit 56118e0",
            "Ulysses' all-to-all is highly efficient within a single machine; its degree cannot "
            "exceed the number of heads; ring attention overlaps its point-to-point transfers "
            "with computation"),
    Sourced("10_long_sequences", "torchtitan (`trainer.py`'s `train_step`, commit b5bcd76)",
            "repo: pytorch/torchtitan torchtitan/trainer.py, Trainer.train_step; "
            "torchtitan/components/loss.py, CrossEntropyLoss.__call__; "
            "torchtitan/distributed/fsdp.py, disable_fsdp_gradient_division (commit b5bcd76)",
            "torchtitan commit b5bcd76",
            "local_valid_tokens += (labels != IGNORE_INDEX).sum() over every micro-batch of the "
            "step, dist_sum_tensor over the \"batch\" mesh; the loss is the reduction=\"sum\" "
            "cross-entropy / global_valid_tokens; disable_fsdp_gradient_division (called from "
            "apply_fsdp_to_decoder) calls module.set_gradient_divide_factor(1.0) on every FSDP "
            "module"),
    Sourced("10_long_sequences", "does it with `calculate_per_token_loss=True`",
            "repo: NVIDIA/Megatron-LM megatron/core/distributed/finalize_model_grads.py, "
            "finalize_model_grads; megatron/core/distributed/distributed_data_parallel.py "
            "(gradient_scaling_factor); megatron/core/pipeline_parallel/schedules.py, "
            "forward_step_calc_loss (commit d98e8a6)",
            "Megatron-LM commit d98e8a6",
            "with calculate_per_token_loss, gradient_scaling_factor = 1.0; finalize_model_grads "
            "all-reduces num_tokens over dp_cp_group and scales the gradients by "
            "1 / clamp(num_tokens, min=1); without it forward_step_calc_loss divides each "
            "micro-batch's loss by clamp(num_tokens, min=1) and by num_microbatches (for a loss "
            "function that returns three values)"),
    Sourced("11_mixture_of_experts", "torch 2.11 has it",
            "release: pytorch/pytorch pull request 168298 (\"Add public grouped_mm\", November "
            "2025); torch 2.11.0's torch/nn/functional.py, grouped_mm",
            "torch 2.11.0+cu130 wheel",
            "defines grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None), which "
            "returns torch._grouped_mm(...); on the CPU it ran float32, bfloat16 and float16 "
            "and refused float64 there as in 2.14 (tests/test_torch_claims.py asks the torch it "
            "runs on)"),
    Sourced("11_mixture_of_experts", "bfloat16 on compute capability 9.x or 10.x runs one "
            "grouped kernel with no wait for the host",
            "repo: pytorch/pytorch aten/src/ATen/native/cuda/GroupedBlas.cpp, _grouped_mm_cuda; "
            "aten/src/ATen/native/GroupedMMUtils.h, _grouped_mm_fallback (commit 00d4eaf)",
            "pytorch main, commit 00d4eaf",
            "use_fast_path = _scaled_mm_allowed_device(sm90_only, sm100_only) (a device whose "
            "major compute capability is 9 or 10) && a, b and out "
            "bfloat16 -> bf16bf16_grouped_mm (\"fast path, no d2h sync needed\"); else "
            "_grouped_mm_fallback, which copies offs to the CPU (offs.value().cpu()) and calls "
            "at::mm_out on each group's slice"),
    Sourced("11_mixture_of_experts", "takes its split sizes as Python lists of ints",
            "torch:distributed/distributed_c10d.py:all_to_all_single",
            "torch 2.14.1",
            "output_split_sizes: list[int] | None, input_split_sizes: list[int] | None; the "
            "docstring: \"(list[Int], optional)\""),
    Sourced("11_mixture_of_experts", "a blocking copy to the host (`.tolist()`, `.item()`) waits "
            "for the work queued before it",
            "repo: pytorch/pytorch docs/source/notes/cuda.rst, \"Asynchronous execution\"",
            "PyTorch documentation, CUDA semantics",
            "GPU operations are enqueued; \"PyTorch automatically performs necessary "
            "synchronization when copying data between CPU and GPU or between two GPUs\"; only "
            "a non_blocking copy (to pinned memory) returns before the data is there"),
    Sourced("11_mixture_of_experts", "DeepSeek-V3 uses 32-way expert parallelism for prefilling",
            "paper: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), section "
            "3.4.1, Prefilling",
            "arXiv 2412.19437v2",
            "\"For the MoE part, we use 32-way Expert Parallelism (EP32), which ensures that each "
            "expert processes a sufficiently large batch size, thereby enhancing computational "
            "efficiency\""),
    Sourced("11_mixture_of_experts", "A dropless layer (DeepSeek-V3's) keeps every assignment",
            "paper: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), section "
            "2.1.2, \"No Token-Dropping\"",
            "arXiv 2412.19437v2",
            "\"DeepSeek-V3 does not drop any tokens during training\" (nor during inference)"),
    Sourced("11_mixture_of_experts", "each overloaded expert's bias goes down by",
            "paper: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), section "
            "2.1.2, \"Auxiliary-Loss-Free Load Balancing\", equations 15-16",
            "arXiv 2412.19437v2",
            "s_i,t = Sigmoid(u_t^T e_i); g'_i,t = s_i,t if s_i,t + b_i is in the top K_r of "
            "{s_j,t + b_j}; \"the bias term is only used for routing\"; \"we keep monitoring "
            "the expert load on the whole batch of each training step. At the end of each step, "
            "we will decrease the bias term by gamma if its corresponding expert is overloaded, "
            "and increase it by gamma if its corresponding expert is underloaded\" (the paper "
            "does not define overloaded; the task takes above the mean load)"),
    Sourced("11_mixture_of_experts", "adds, beside the routed experts' weighted sum",
            "paper: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), section "
            "2.1.2, equation 12",
            "arXiv 2412.19437v2",
            "h'_t = u_t + sum_{i=1}^{N_s} FFN^(s)_i(u_t) + sum_{i=1}^{N_r} g_i,t FFN^(r)_i(u_t); "
            "N_s shared experts, N_r routed"),
    Sourced("11_mixture_of_experts", "It penalises large logits going into the router",
            "paper: Zoph et al., ST-MoE (arXiv 2202.08906), section 3.3, equations 5-6, and "
            "section 3.4, \"An aside on the router z-loss\"",
            "arXiv 2202.08906",
            "L_z(x) = 1/B sum_i (log sum_j e^{x_j^(i)})^2, B tokens, N experts, x the logits "
            "going into the router; \"This penalizes large logits into the gating network\"; "
            "roundoff errors in exponentials (bfloat16's up to 65,536x float32's) change the "
            "routing and the probability that scales an expert's output; c_z = 0.001 in "
            "L_tot = L_CE + c_B L_B + c_z L_Z"),
    Sourced("11_mixture_of_experts", "builds for CUDA 13.3 and later add a cuBLASLt path",
            "torch:_meta_registrations.py:_grouped_mm_fp16_cublaslt_supported",
            "torch 2.14.1",
            "float16 grouped_mm \"requires cuBLASLt grouped GEMM support\": a CUDA device, 1 to "
            "1024 groups, torch.version.cuda >= (13, 3) and compute capability 9 to 11"),
    # lesson 10, torch's context_parallel in practice (its ring runs only on CUDA kernels)
    Sourced("10_long_sequences", "the model's parameters are not buffers",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:context_parallel",
            "torch 2.14.1 (the same in 2.11.0)",
            "its docstring: \"Note that ``buffers`` should not contain any nn.Parameter\""),
    Sourced("10_long_sequences", "On entry `context_parallel` clones every buffer it will restore, "
            "then shards each in place; on exit it copies the clones back",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:context_parallel",
            "torch 2.14.1 (the same in 2.11.0)",
            "original_buffers = [None if b in no_restore_buffers else b.clone() ...] before the "
            "shards are copied in with resize_ and copy_; after the yield each original is "
            "copied back into its buffer"),
    Sourced("10_long_sequences", "one all-gather brings every rank's keys and values, started "
            "before the rank attends to its own block and waited for when the next block is needed",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:_AllGatherRotater",
            "torch 2.14.1 (the same in 2.11.0)",
            "exchange_buffers issues all_gather_single (all_gather_tensor in 2.11.0) once (a "
            "functional collective, not waited "
            "for); _templated_ring_attention calls it at step 0 before attending to its own "
            "block, and next_buffer waits at step 1"),
    Sourced("10_long_sequences", "instead passes a block to the next rank $W - 1$ times",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:_templated_ring_attention",
            "torch 2.14.1 (the same in 2.11.0)",
            "exchange_buffers runs for i < size - 1; _AllToAllRotater.exchange_buffers is "
            "permute_tensor to rank + 1"),
    Sourced("10_long_sequences", "the memory-efficient and cuDNN ones refuse an `attn_bias`, the "
            "flash one has none",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:_scaled_dot_product_ring_efficient_attention",
            "torch 2.14.1 (the same in 2.11.0)",
            "it and _scaled_dot_product_ring_cudnn_attention raise NotImplementedError(\"attn_bias "
            "is not supported yet\"); _scaled_dot_product_ring_flash_attention takes no mask"),
    Sourced("10_long_sequences", "torch's FlexAttention path shards a `BlockMask` instead",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:_context_parallel_shard",
            "torch 2.14.1 (the same in 2.11.0)",
            "\"Buffers can be either tensors or `BlockMask` objects\"; _context_parallel_buffers "
            "shards a BlockMask for flex_attention's context parallel"),
    Sourced("10_long_sequences", "torch's ring merges that with the output as it is",
            "torch:distributed/tensor/experimental/_context_parallel/_attention.py:"
            "_SDPAMerger._merge_one",
            "torch 2.14.1 (the same in 2.11.0)",
            "the block's log-sum-exp is unsqueezed and merged with the running one by "
            "out - sigmoid(block_lse - lse) * (out - block_out), with no slice to the output's "
            "rows; _templated_ring_attention passes the kernel's logsumexp to it unchanged"),
    Sourced("11_mixture_of_experts", "composes them as torchtitan did until March 2026 (the "
            "same layout, now written in one call: below; its mesh calls the experts' dimension "
            "`efsdp`)",
            "repo: pytorch/torchtitan torchtitan/distributed/fsdp.py, apply_fsdp_to_decoder and "
            "resolve_sparse_fsdp_mesh (commit b5bcd76); torchtitan/models/llama4/parallelize.py, "
            "apply_fsdp, at 18a46d427's parent",
            "torchtitan commit b5bcd76 (and 18a46d427^)",
            "routed experts are sharded over edp_mesh, whose FSDP axis is \"efsdp\", the block's "
            "other parameters over dp_mesh, then fully_shard(model); before 18a46d427 as two "
            "calls, fully_shard(transformer_block.moe.experts, mesh=edp_mesh) then "
            "fully_shard(transformer_block, mesh=dp_mesh)"),
    Sourced("11_mixture_of_experts",
            "Until March 2026 torchtitan wrote it as `fully_shard_ep` does",
            "repo: pytorch/torchtitan commit 18a46d427 (pull request 2281, \"[FSDP2] enable "
            "per-param mesh FSDP2 for MoE\", 26 March 2026), "
            "torchtitan/models/llama4/parallelize.py",
            "torchtitan commit 18a46d427",
            "replaces the experts' own fully_shard over edp_mesh with one fully_shard(block) whose "
            "shard_placement_fn returns ShardPlacementResult(placement, mesh_info) per parameter: "
            "edp_mesh for the experts, dp_mesh for the rest"),
    Sourced("11_mixture_of_experts", "FSDP2's per-parameter mesh, which torch 2.14 has",
            "torch:distributed/fsdp/_fully_shard/_fsdp_common.py:ShardPlacementResult",
            "torch 2.14.1",
            "a dataclass of placement and mesh_info that a shard_placement_fn may return for a "
            "parameter, so that it is sharded over its own mesh"),
    Sourced("11_mixture_of_experts", "has `dp_shard * cp * tp / ep` ranks",
            "repo: pytorch/torchtitan torchtitan/config/configs.py, ParallelismConfig."
            "expert_parallel_degree; torchtitan/distributed/parallel_dims.py (commit b5bcd76)",
            "torchtitan commit b5bcd76",
            "\"EP borrows ranks from FSDP and TP: efsdp = dp_shard * cp * tp / ep\"; "
            "parallel_dims: \"efsdp: FSDP in the EP region\", the sparse mesh "
            "(pp, dp_replicate, efsdp, ep)"),
]
