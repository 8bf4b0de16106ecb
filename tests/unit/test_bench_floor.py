"""``bench/decision.py``'s contract floor answers the bench's request as the
router does (the same headers set and removed, the same metadata keys, the
same body): the row measures the router's answer without its decision, not
a smaller answer."""

from __future__ import annotations

import sys
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.contract import NAMESPACE
from sidecar.handlers.extproc import Processor
from sidecar.serve.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import decision as bench  # noqa: E402


def _answers(processor, i: int) -> list[pb.ProcessingResponse]:
    return bench.answers(processor, i)


def _shape(answer: pb.ProcessingResponse) -> tuple:
    common = answer.request_body.response
    mutation = common.header_mutation
    return (
        [h.header.key for h in mutation.set_headers], list(mutation.remove_headers), common.body_mutation.body,
        set(answer.dynamic_metadata.fields[NAMESPACE].struct_value.fields), common.clear_route_cache,
    )


def test_the_contract_floor_sends_the_routers_answer_without_deciding(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(bench.CONFIG % bench.KEYS)
    router, floor = Processor(Runtime(str(config))), bench.ContractFloor()
    for i in range(20):  # both arms
        got, want = _answers(floor, i), _answers(router, i)
        assert len(got) == len(want) == 2
        assert got[0].mode_override.request_body_mode == want[0].mode_override.request_body_mode
        if want[1].dynamic_metadata.fields[NAMESPACE].struct_value.fields["variant"].string_value == "control":
            assert _shape(got[1]) == _shape(want[1])
