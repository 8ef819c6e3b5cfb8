"""The device's n-gram lookup (``engine/ngram_device.py``) proposes exactly what the host
reference (``ngram_proposer.propose``) does, on streams assembled from a host window, the
proposals a step in flight accepted, and the slot's last token."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jbatch.engine import ngram_device, ngram_proposer

K, W = 4, 24


@pytest.mark.parametrize("ngram", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_device_lookup_equals_the_host_rule(ngram):
    rng = np.random.RandomState(sum(ngram))
    groups = 400
    streams, window, window_len, accepted, num_accepted, last, cap = [], [], [], [], [], [], []
    for _ in range(groups):
        vocab = int(rng.randint(2, 7))  # small vocabularies: many matches, many ties
        na = int(rng.randint(-1, K + 1))  # -1: the window ends with the last token
        wl = int(rng.randint(1 if na < 0 else 0, W + 1))
        n = wl + na + 1
        stream = rng.randint(0, vocab, n).tolist()
        window.append(stream[:wl] + [0] * (W - wl))
        window_len.append(wl)
        acc = stream[wl : wl + max(na, 0)]
        accepted.append(acc + [int(rng.randint(vocab))] * (K - len(acc)))  # stale past them
        num_accepted.append(na)
        last.append(stream[-1])
        cap.append(int(rng.randint(0, K + 1)))
        streams.append(stream)
    arr = lambda x: np.asarray(x, np.int32)

    @jax.jit
    def device(window, window_len, accepted, num_accepted, last, cap):
        s, length = ngram_device.assemble(window, window_len, accepted, num_accepted, last)
        return length, *ngram_device.propose(s, length, cap, K, *ngram)

    length, drafts, count = device(
        arr(window), arr(window_len), arr(accepted), arr(num_accepted), arr(last), arr(cap)
    )
    for g, stream in enumerate(streams):
        assert int(length[g]) == len(stream)
        want = ngram_proposer.propose(np.asarray(stream, np.int32), cap[g], *ngram)
        got = drafts[g, : int(count[g])].tolist()
        assert got == want, (stream, cap[g], got, want)
    assert int(np.sum(count > 0)) > groups // 8  # the test sees many proposals
