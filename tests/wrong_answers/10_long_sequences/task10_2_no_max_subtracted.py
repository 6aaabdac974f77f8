"""Exponentiates the lse directly: e^lse overflows float32 once lse passes 88."""

TASK = "task10_2"
EXPECT = r"inf or NaN .*subtract each row's larger lse"


def merge_partials(out_a, lse_a, out_b, lse_b):
    total = torch.exp(lse_a) + torch.exp(lse_b)
    out = (torch.exp(lse_a) / total).unsqueeze(-1) * out_a + (
        torch.exp(lse_b) / total).unsqueeze(-1) * out_b
    return out, torch.log(total)
