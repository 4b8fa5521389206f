"""The probe batch: ``probe_tokens`` counts every token the attention layers see, a pair task's second
document included (checked on the layers' own inputs, captured by hooks)."""

from __future__ import annotations

import torch

from lra_cond.callbacks.layer_inputs import capture_layer_inputs, take_probe_batch
from lra_cond.data.documents import document_keys
from lra_cond.training.module import LraModel


def pair_batch(lengths: list[tuple[int, int]], seq: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {"label": torch.zeros(len(lengths), dtype=torch.long)}
    for doc, (ids_key, length_key) in enumerate(document_keys(pair=True)):
        length = torch.tensor([pair[doc] for pair in lengths])
        ids = torch.randint(1, 200, (len(lengths), seq), generator=g)
        ids[torch.arange(seq)[None, :] >= length[:, None]] = 0
        out[ids_key], out[length_key] = ids, length
    return out


def tokens_seen(model: torch.nn.Module, probe: dict[str, torch.Tensor]) -> list[int]:
    """Real (unmasked) tokens each attention layer receives on ``probe``."""
    return [int((~mask).sum()) for _, _, mask in capture_layer_inputs(model, probe)]


def test_a_pair_tasks_documents_share_the_probe_tokens() -> None:
    torch.manual_seed(0)
    model = LraModel(task="retrieval", dim=16, mlp_dim=32, max_len=300).eval()
    # long documents: one example, each document cropped to half of the probe
    probe = take_probe_batch([pair_batch([(300, 280), (290, 250)])], 256)
    assert probe["length"].tolist() == [128] and probe["length2"].tolist() == [128]
    assert probe["input_ids"].shape == (1, 128) and probe["input_ids2"].shape == (1, 128)
    assert tokens_seen(model, probe) == [256, 256]
    # short ones: whole examples while both documents together come closer to the probe's size
    probe = take_probe_batch([pair_batch([(100, 90), (40, 30), (80, 70)])], 256)
    assert probe["length"].tolist() == [100, 40] and probe["length2"].tolist() == [90, 30]
    assert tokens_seen(model, probe) == [260, 260]
    # 6 short of it, the next example (256) would overshoot by 250: left out (tiny Retrieval's case)
    probe = take_probe_batch([pair_batch([(128, 122), (200, 200)])], 256)
    assert probe["length"].tolist() == [128] and probe["length2"].tolist() == [122]
    assert tokens_seen(model, probe) == [250, 250]


def test_a_single_document_task_crops_each_example_to_the_probe() -> None:
    torch.manual_seed(0)
    model = LraModel(task="listops", dim=16, mlp_dim=32, max_len=300).eval()

    def probe_of(lengths: list[int], tokens: int) -> list[int]:
        batch = {"input_ids": torch.randint(1, 16, (len(lengths), 300)), "length": torch.tensor(lengths)}
        batch["input_ids"][torch.arange(300)[None, :] >= batch["length"][:, None]] = 0
        probe = take_probe_batch([batch], tokens)
        assert tokens_seen(model, probe) == [int(probe["length"].sum())] * 2
        return probe["length"].tolist()

    assert probe_of([300, 300], 160) == [160]  # one long example, cropped
    # examples (each cropped to 160) while their tokens come closer to 160: 100 + 70 overshoots
    # by 10 where 100 falls 60 short; 100 + 160 would overshoot by 100
    assert probe_of([100, 70, 300], 160) == [100, 70]
    assert probe_of([100, 300, 300], 160) == [100]
    assert probe_of([100, 120, 300], 160) == [100, 120]  # a tie (60 either way) takes it
    assert probe_of([50, 20, 30, 80, 300], 160) == [50, 20, 30, 80]  # 60 short, 20 over: taken
