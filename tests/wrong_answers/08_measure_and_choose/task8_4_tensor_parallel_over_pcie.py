"""Picks tensor parallelism whenever the activations must be split, whatever links the GPUs of
a node have."""

TASK = "task8_4"
EXPECT = r"over PCIe: choose_method.*returned 'tp\+fsdp'; the table says 'pp\+fsdp'"


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
    if state / num_gpus + activation_bytes <= gpu_memory:
        return "fsdp"
    if state / num_gpus + activation_bytes / gpus_per_node <= gpu_memory:
        return "tp+fsdp"
    raise ValueError(f"needs {state / num_gpus} bytes")
