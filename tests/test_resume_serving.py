"""A server restart with ``snapshot_dir``: gRPC streams cut by the shutdown are resumed by their
clients on the next server (same request_id, ``resume``, ``resume_from_token``) and end with
exactly the tokens of an uninterrupted run (the session MockCore engine: known outputs)."""

from __future__ import annotations

import grpc
import pytest

from jbatch import SamplingParams
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.sampling_proto import sampling_params_to_proto
from tests.serving_harness import assert_drained, hardened_llm, running_server, slow_steps

__all__ = ["hardened_llm"]

MAX_TOKENS = 60


def _request(i: int, prompt: list[int]) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=f"client-{i}",
        token_ids=pb.TokenIds(ids=prompt),
        sampling_params=sampling_params_to_proto(params),
    )


def test_streams_resume_after_a_restart(hardened_llm, tmp_path):
    h = hardened_llm
    snap = tmp_path / "snapshot"
    prompts = [[5 + i, 17, 33 + i, 8] for i in range(4)]
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    channel = None
    with running_server(h, snapshot_dir=str(snap)) as first, slow_steps(first.thread, 0.02):
        channel = grpc.insecure_channel(first.grpc_target)  # open past the shutdown
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Generate(_request(i, p), timeout=30) for i, p in enumerate(prompts)]
        for i, call in enumerate(calls):  # a few responses each, then the server stops
            for resp in call:
                got[i] += resp.token_ids
                if len(got[i]) >= 3 + i:
                    break
    # Leaving running_server stopped the server: the engine was snapshotted, streams cut.
    assert (snap / "meta.json").is_file() and (snap / "streams.json").is_file()
    for i, call in enumerate(calls):
        with pytest.raises(grpc.RpcError) as err:
            for resp in call:  # what arrived before the cut
                got[i] += resp.token_ids
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "resume" in err.value.details()
        assert len(got[i]) < MAX_TOKENS
    channel.close()

    with running_server(h, snapshot_dir=str(snap)) as second:
        assert not snap.exists()  # consumed by the restore
        with grpc.insecure_channel(second.grpc_target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for i in range(4):
                req = pb.GenerateRequest(request_id=f"client-{i}", resume=True,
                                         resume_from_token=len(got[i]))  # fmt: skip
                last = None
                for resp in stub.Generate(req, timeout=30):
                    got[i] += resp.token_ids
                    last = resp
                assert last.finish_reason == pb.FINISH_REASON_LENGTH
                assert got[i] == h.expected(prompts[i], MAX_TOKENS), i
            with pytest.raises(grpc.RpcError) as err:  # nothing left to resume
                list(stub.Generate(pb.GenerateRequest(request_id="client-0", resume=True)))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert_drained(second)
