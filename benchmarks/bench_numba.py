"""Does a numba kernel beat torch on the CPU copy loops of the host tier? (run by hand)

    pip install numba && python -m benchmarks.bench_numba

Two loops, at the bench_hf shape (8 layers, 4 KV heads, head dim 64, fp32, block size 16):

1. gather of a 1,024-token prefix whose block ids are scattered (no runs: the case
   ``cuda_ext.cpu_runs`` hands to the pure-torch reference) into a ``[1, H, T, D]`` view;
2. ``radixkv.store.tier.copy_blocks`` of 64 scattered blocks between two pools (a demotion of a
   fragmented node): a loop of slice copies, one ``index_select`` + ``index_copy_`` per layer
   (what copy_blocks does below 4 blocks per run), and a numba loop.

numba is not a dependency of radixkv: this only decides whether it should become one
(docs/design.md has the figures and the decision).
"""

from __future__ import annotations

import statistics
import time

import torch

import cuda_ext
from radixkv import BlockPool, LayerSpec
from radixkv.store.tier import _id_runs

L, NB, BS, H, D, N, CAP = 8, 512, 16, 4, 64, 1024, 1536


def _median_ms(fns: dict, runs: int = 15) -> dict:
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def main() -> None:
    import numba

    torch.set_num_threads(1)

    @numba.njit(nogil=True)
    def gather_nb(pool, ids, num_tokens, out):  # pool [nb, bs, H, D] -> out [H, T, D]
        bs, heads, dim = pool.shape[1], pool.shape[2], pool.shape[3]
        for h in range(heads):
            for j in range(ids.shape[0]):
                t0 = j * bs
                for t in range(min(bs, num_tokens - t0)):
                    for d in range(dim):
                        out[h, t0 + t, d] = pool[ids[j], t, h, d]

    @numba.njit(nogil=True)
    def copy_nb(src, sids, dst, dids):
        for j in range(sids.shape[0]):
            dst[dids[j]] = src[sids[j]]

    torch.manual_seed(0)
    spec = LayerSpec(H, D, D, torch.float32, torch.device("cpu"))
    src, dst = BlockPool([spec] * L, NB, BS), BlockPool([spec] * L, NB, BS)
    for t in src.k + src.v:
        t.copy_(torch.randn_like(t))
    ids = torch.randperm(NB)[: N // BS]
    k_out = [torch.empty(1, H, CAP, D)[:, :, :N] for _ in range(L)]
    v_out = [torch.empty(1, H, CAP, D)[:, :, :N] for _ in range(L)]
    ids_np = ids.numpy()

    def gather_numba() -> None:
        for pool, out in zip(src.k + src.v, k_out + v_out):
            gather_nb(pool.numpy(), ids_np, N, out[0].numpy())

    gather_numba()  # compile
    want = [torch.empty(1, H, N, D) for _ in range(2 * L)]
    cuda_ext.paged_gather(src.k, src.v, ids.view(1, -1), N, want[:L], want[L:])
    assert all(torch.equal(a, b) for a, b in zip(k_out + v_out, want)), "numba gather differs"
    gather = _median_ms(
        {
            "torch (cuda_ext on CPU)": lambda: cuda_ext.paged_gather(
                src.k, src.v, ids.view(1, -1), N, k_out, v_out
            ),
            "numba": gather_numba,
        }
    )

    s_ids, d_ids = torch.randperm(NB)[:64], torch.randperm(NB)[:64]
    runs = _id_runs(s_ids.tolist(), d_ids.tolist())
    pairs = list(zip(src.k + src.v, dst.k + dst.v))

    def slices() -> None:
        for a, b in pairs:
            for s, d, n in runs:
                b[d : d + n].copy_(a[s : s + n])

    def indexed() -> None:
        for a, b in pairs:
            b.index_copy_(0, d_ids, a.index_select(0, s_ids))

    def copy_numba() -> None:
        for a, b in pairs:
            copy_nb(a.numpy(), s_ids.numpy(), b.numpy(), d_ids.numpy())

    copy_numba()  # compile
    copies = _median_ms({"slice per run": slices, "index_select + index_copy_": indexed, "numba": copy_numba})
    print(f"numba {numba.__version__}, torch {torch.__version__}, 1 torch thread")
    print(f"1. scattered gather, {N} tokens x {L} layers (K and V):")
    for name, ms in gather.items():
        print(f"   {name:<28} {ms:7.2f} ms ({ms / gather['torch (cuda_ext on CPU)']:.2f}x)")
    print(f"2. copy_blocks of 64 scattered blocks x {L} layers (K and V):")
    for name, ms in copies.items():
        print(f"   {name:<28} {ms:7.2f} ms ({ms / copies['index_select + index_copy_']:.2f}x)")


if __name__ == "__main__":
    main()
