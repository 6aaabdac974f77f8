"""Divides the activations by the GPUs under FSDP too: but each GPU of FSDP runs its own share
of the batch through the whole model, and keeps all of that share's activations."""

TASK = "task8_4"
EXPECT = r"long sequences: choose_method.*returned 'fsdp'; the table says 'tp\+fsdp'"


def choose_method(model_bytes, activation_bytes, gpu_memory, num_gpus, gpus_per_node, link,
                  moe=False):
    if link not in ("nvlink", "pcie") or min(model_bytes, gpu_memory, num_gpus) <= 0:
        raise ValueError("bad arguments")
    if num_gpus % gpus_per_node:
        raise ValueError("not whole nodes")
    state = 4 * model_bytes
    if state + activation_bytes <= gpu_memory:
        return "one device" if num_gpus == 1 else "ddp"
    if num_gpus == 1:
        raise ValueError(f"needs {state + activation_bytes} bytes")
    if (state + activation_bytes) / num_gpus <= gpu_memory:
        return "fsdp"
    if state / num_gpus + activation_bytes / gpus_per_node <= gpu_memory:
        return "tp+fsdp" if link == "nvlink" else "pp+fsdp"
    raise ValueError(f"needs {state / num_gpus} bytes")
