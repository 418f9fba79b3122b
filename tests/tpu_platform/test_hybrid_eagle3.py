# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 head on a hybrid target in the runner, with JAX alone (no vLLM): a random head of
vLLM's layout drafts for a tiny random Qwen3-Next or Qwen3.5 (three Gated DeltaNet layers and one
full attention one, a KV-cache group each). It reads the outputs of two Gated DeltaNet layers and of
the full-attention one (the step program's extra output, taken after any layer kind), and its
cache follows the block tables of the target's full-attention group (the state groups hold
states). After a prompt prefilled in two chunks and after each verification, its drafts are
exactly what an independent torch reference of the head proposes on transformers' hidden
states; the verified drafts keep none, one, all and again none of the target's greedy tokens
(only the target's state layers keep 1 + k blocks a request), and the output is the target's
greedy continuation token for token (transformers), with the hand-counted accepted drafts;
nothing compiles after warm-up (`make test-full`; in `make test` the proposer's wiring on the
hybrid target, compiling nothing: its layers, its cache's group, the refusal of other groups)."""

import pytest
import torch
import transformers

from tests.eagle3_reference import Eagle3Reference
from tests.models.tiny_checkpoints import VOCAB, prompts
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.speculation_driver import PROMPT_LEN, assert_verified_like_reference, speculating_runner
from tests.tiny_models import save_tiny_eagle3_head
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.speculation import SpeculationConfig
from tpu_platform.step_program import KVLayout

K = 3
# Inputs of layers 1 and 3 (Gated DeltaNet layers 0 and 2's outputs) and index 4: the full
# attention layer's output before the final norm.
AUX = (1, 3, 4)


def _checkpoints(root, architecture: str = "Qwen3NextForCausalLM") -> tuple[str, str]:
    """A tiny random hybrid target of `architecture` and a random head made for it."""
    target = save_tiny_qwen3_next(str(root / "target"), seed=5, architecture=architecture)
    head = save_tiny_eagle3_head(str(root / "head"), target, seed=7, aux_layer_ids=AUX, draft_vocab_size=256)
    return target, head


def test_the_head_reads_the_hybrid_targets_layers_and_follows_its_full_attention_group(tmp_path):
    dirs = _checkpoints(tmp_path)
    runner = Runner(
        RunnerConfig(model_path=dirs[0], max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16,
                     page_size=16, native_dense=False,
                     speculation=SpeculationConfig(num_tokens=K, method="eagle3", draft_model=dirs[1]))
    )  # fmt: skip
    runner.load_model()
    head = runner.speculation.draft
    assert runner.speculation.aux_layers == AUX  # what the target's step program hands the head
    assert head.cache_group == 3  # the three linear layers' groups, then the full one's
    facts = dict(page_size=16, kv_dtype=runner.kv_dtype, backend=runner.backend, feed_width=1,
                 device=runner.device)  # fmt: skip
    with pytest.raises(ValueError, match=r"'eagle3' expects 4 KV-cache groups .* made 1; use method 'ngram'"):
        head.initialize(8, num_groups=1, **facts)
    runner.initialize_kv_cache(num_pages=8, layout=KVLayout.for_model(runner.model_config))
    # One layer's cache, shaped as the target's full-attention layer's (its last array; the
    # Gated DeltaNet layers' are state pools), read through that group's tables.
    assert [c.shape for c in head.kv_caches] == [runner.kv_caches[-1].shape]
    assert head._shape.group == 3


@pytest.mark.full  # a hybrid target's programs and the head's two a step shape: minutes on two cores
@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_an_eagle3_head_drafts_what_the_reference_does_for_a_hybrid_target(tmp_path, architecture):
    target_dir, head_dir = _checkpoints(tmp_path, architecture)
    layout = lambda runner: KVLayout.for_model(runner.model_config)  # noqa: E731
    runner = speculating_runner(target_dir, "eagle3", head_dir, K, num_pages=20, layout=layout)
    assert runner.speculation.draft.cache_group == 3  # the three linear layers' groups, then the full one's
    assert runner.speculation.aux_layers == AUX
    target = (
        getattr(transformers, architecture)
        .from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    reference = Eagle3Reference(head_dir, target, AUX)
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    # The full group's KV pages; each state group's 1 + K state slots.
    blocks = [[1 + g + 4 * j for j in range(1 + K)] for g in range(4)]
    assert_verified_like_reference(
        runner, target, lambda history: reference.drafts(history, K), prompt, K, keeps=(0, 1, K, 0),
        vocab=VOCAB, blocks=blocks,
    )  # fmt: skip
    assert runner.speculation.stats.accepted_tokens == 0 + 1 + K + 0
