"""A small byte-level BPE tokenizer trained locally and deterministically, so nothing is downloaded.

Every worker trains the same tokenizer from the same built-in text; a weights directory carries
its own tokenizer files and loads them instead.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Plain English, written for this project, so the merges cover everyday words and the
# tokenizer does not depend on any downloaded corpus.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A short request should never wait behind a long one.
Explain quantum computing in simple terms. A quantum computer uses qubits, which can hold a mix of
zero and one at the same time, and it reads an answer by measuring them.
Mixture of experts models split a large network into many small experts. A router picks a few
experts for every token, so each token only pays for the experts it uses.
The scheduler looks at every job, gives it a score and runs the most urgent work first. When the
system is busy, batch jobs wait and interactive jobs keep their promises.
Once upon a time there was a little robot who liked to read books about the sea, the sky and the
mountains. Every morning it walked to the library, opened a new book and learned something new.
Please write a short poem about the ocean at night. The waves are quiet, the stars are bright,
and the moon draws a silver road across the water.
What is the capital of France? Paris is the capital of France, and it is known for its museums,
its cafes and the tall iron tower by the river.
How do I bake bread? Mix flour, water, salt and yeast, knead the dough, let it rise for an hour,
shape it, let it rise again, then bake it in a hot oven until the crust is golden brown.
Summarise this paragraph in one sentence. Translate the following text into French. Give me three
reasons to learn a second language. Tell me a story about a dragon and a brave knight.
Numbers and code: 0 1 2 3 4 5 6 7 8 9 10 100 1000, def main(): return 42, x = y + z * 2.
"""


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines * 4, trainer=trainer)
    return tokenizer


@lru_cache(maxsize=8)
def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train (once per process) the built-in tokenizer with at most ``vocab_size`` tokens."""
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_train(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
    )
    return fast


def encode_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """Token ids of ``prompt``, with the beginning-of-sequence token first."""
    ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ([int(bos)] if bos is not None else []) + [int(i) for i in ids]
