"""What expert parallelism costs, measured: its all-to-alls against lesson 08's latency-bandwidth
fit, and the tokens each expert gets over training, with and without the load-balancing loss.

    torchrun --standalone --nproc-per-node=2 lessons/11_mixture_of_experts/moe_costs.py
    torchrun ... moe_costs.py --plot balance.svg

First, lesson 08's benchmark times all-reduces of 4 kB to 4 MB and fits the link's latency
alpha and time per byte beta (the ring: 2 (W - 1) alpha + 2 (W - 1) / W n beta). An all-to-all
in which each rank sends n bytes, n / W of them to every rank, is W - 1 messages and
(W - 1) / W n bytes out of each rank: predicted (W - 1) alpha + (W - 1) / W n beta. It is timed
the same way (the slowest rank's mean, the median of 5 loops) at the size of one MoE layer's
dispatch of T tokens a rank: n = T k C b (k experts a token, width C, b bytes an element), and
the same model is also fitted to those times.

Then train_ep.py's model (a mixture of experts in every block, the experts split across the
ranks) trains --steps steps twice, with --aux-weight 0 and with it, nothing dropped (no
capacity: the router's choice shows whole). Each step records the tokens sent to each expert,
summed over the ranks, and the busiest expert over the mean (1: even). A rank's load is the sum
of its experts': with one expert a rank, that ratio sets the pace; with several, it bounds the
busiest rank's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/, where gpt/ lives
sys.path.insert(0, str(HERE.parent / "08_measure_and_choose"))  # lesson 08's benchmark
from bench_collectives import fit_alpha_beta, sizes_between, time_collective  # noqa: E402
from gpt import GPTConfig, run  # noqa: E402 - the plumbing every script shares
from moe import split_parameters  # noqa: E402 - lesson 11's layer
from train_ep import moe_gpt, sync_gradients  # noqa: E402 - lesson 11's model and its sync


def predict_all_to_all_seconds(num_bytes: int, world: int, alpha: float, beta: float) -> float:
    """W - 1 messages, and (W - 1) / W of the n bytes leave each rank."""
    return (world - 1) * alpha + (world - 1) / world * num_bytes * beta


def exchange_costs(args, world: int, device: torch.device, log) -> dict:
    """alpha and beta from all-reduces, then each dispatch size measured and predicted."""
    sizes = sizes_between(4096, 4 * 1024 * 1024)
    seconds = [time_collective("all_reduce", n, device) for n in sizes]
    alpha, beta = fit_alpha_beta(sizes, seconds, world)
    log(f"lesson 08's fit to all-reduces of 4 kB to 4 MB on {world} ranks: alpha "
        f"{alpha * 1e6:.1f} us, 1/beta {1 / beta / 1e9:.2f} GB/s")
    log(f"one dispatch: T tokens a rank x k {args.k} x width {args.width} x 4 bytes")
    log(f"{'T':>6} {'bytes':>10} {'measured (us)':>14} {'predicted (us)':>15}")
    rows = []
    for tokens in args.tokens:
        n = tokens * args.k * args.width * 4
        measured = time_collective("all_to_all", n, device)
        predicted = predict_all_to_all_seconds(n, world, alpha, beta)
        rows.append({"tokens": tokens, "bytes": n, "seconds": measured, "predicted": predicted})
        log(f"{tokens:>6} {n:>10,} {measured * 1e6:>14.1f} {predicted * 1e6:>15.1f}")
    result = {"alpha": alpha, "beta": beta, "all_to_all": rows}
    if len(rows) >= 2:  # the same model fitted to the all-to-alls themselves, as lesson 08
        # fits (weighted by 1 / t**2); its all-reduce terms are twice the all-to-all's
        a, b = fit_alpha_beta([r["bytes"] for r in rows], [r["seconds"] for r in rows], world)
        result["all_to_all_alpha"], result["all_to_all_beta"] = 2 * a, 2 * b
        log(f"fitted to these all-to-alls instead: alpha {result['all_to_all_alpha'] * 1e6:.1f} "
            f"us, 1/beta {1 / result['all_to_all_beta'] / 1e9:.2f} GB/s")
    return result


def busiest_over_mean(args, aux_weight: float, device: torch.device) -> list[float]:
    """Per step: the busiest expert's tokens over the mean, summed over the ranks, averaged over
    the blocks, training train_ep.py's model with this auxiliary-loss weight."""
    dataset, train_set, _ = run.windows("tiny")
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size)
    model = moe_gpt(config, args.seed, args.experts, args.k, None, None).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held, own = split_parameters(model)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True)
    found, epoch = [], 0
    while len(found) < args.steps:
        sampler.set_epoch(epoch := epoch + 1)
        for inputs, targets in loader:
            _, loss = run.next_char_loss(model, inputs.to(device), targets.to(device))
            aux = sum(block.mlp.aux for block in model.blocks)
            optimizer.zero_grad(set_to_none=True)
            (loss + aux_weight * aux).backward()
            sync_gradients(held, own)
            optimizer.step()
            load = torch.stack([block.mlp.load for block in model.blocks]).float()
            dist.all_reduce(load)  # (blocks, experts): every rank's tokens
            found.append((load.max(dim=1).values / load.mean(dim=1)).mean().item())
            if len(found) == args.steps:
                break
    return found


def plot_balance(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, values in curves.items():
        axes.plot(range(1, len(values) + 1), values, label=label)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set(xlabel="training step", ylabel="busiest expert's tokens / the mean", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})  # no date: the file is stable
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: [run.positive_int(t) for t in s.split(",")],
                        default=[64, 256, 1024, 4096], help="tokens a rank, comma-separated")
    parser.add_argument("--width", type=run.positive_int, default=32,
                        help="of the timed dispatch only (the trained model's is tiny's, 32)")
    parser.add_argument("--experts", type=run.positive_int, default=4)
    parser.add_argument("--k", type=run.positive_int, default=2, help="experts per token")
    parser.add_argument("--steps", type=run.positive_int, default=200)
    parser.add_argument("--batch-size", type=run.positive_int, default=16)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--plot", type=Path, help="draw the balance over training here (SVG)")
    parser.add_argument("--result", type=Path, help="write the numbers here as JSON (rank 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:  # a partial launcher environment, nccl without a GPU per rank
        return run.refuse(__file__, err)
    share = -(-len(run.windows("tiny")[1]) // world)  # a rank's training windows
    if (world < 2 or args.experts % world or not 1 <= args.k <= args.experts
            or args.batch_size > share):  # (no full batch: the training loop would never end)
        dist.destroy_process_group()
        return run.refuse(__file__, f"{world} ranks: start 2 or more with torchrun, --experts "
                                    f"({args.experts}) a multiple of them, --k 1 to --experts, "
                                    f"--batch-size at most a rank's {share} windows")
    log = run.rank_zero_log(rank)
    result = exchange_costs(args, world, device, log)
    curves = {f"aux weight {w:g}": busiest_over_mean(args, w, device)
              for w in (0.0, args.aux_weight)}
    log(f"busiest expert's tokens / the mean ({args.experts} experts, top-{args.k}, "
        f"{args.steps} steps of {world} x {args.batch_size} windows, mean over the blocks):")
    log(f"{'step':>6} " + " ".join(f"{label:>16}" for label in curves))
    every = max(1, args.steps // 8)
    for step in sorted({*range(0, args.steps, every), args.steps - 1}):
        log(f"{step + 1:>6} " + " ".join(f"{values[step]:>16.2f}" for values in curves.values()))
    result["balance"] = curves
    if rank == 0 and args.plot:
        plot_balance(curves, args.plot, f"{args.experts} experts, top-{args.k}, {world} ranks")
        log(f"plot written to {args.plot}")
    dist.destroy_process_group()
    if rank == 0 and args.result:
        run.write_result(result, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
