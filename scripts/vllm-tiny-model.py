"""Builds the test bed's model (issue 19): no model can be downloaded here, so make one.

A BPE tokenizer trained on generated English-like text (about 700 tokens, a chat template
for /v1/chat/completions) and a 2-layer LlamaForCausalLM (hidden 128, 4 heads) with random
weights from a fixed seed. Its output is nonsense but deterministic: greedy decoding of the
same prompt gives the same tokens on any engine that loads it, which is all the tests compare.

    python scripts/vllm-tiny-model.py OUT_DIR
"""
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20261203
VOCAB = 700
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(rng: random.Random) -> list[str]:
    words = (
        "the a an of to in on for with by at from kv cache block lease prefill decode engine router "
        "agent token request stream read write peer gone alive heartbeat deadline clock model batch "
        "prompt answer queue drain probe ready health event log sequence node graph memory region "
        "transfer remote local host port time second minute quick brown fox jumps over lazy dog "
        "one two three four five six seven eight nine ten red green blue light dark fast slow"
    ).split()
    lines = []
    for _ in range(4000):
        n = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "!", "?", ","]))
    lines += [str(i) for i in range(1000)]
    return lines


def main(out: str) -> None:
    rng = random.Random(SEED)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger than the default init: output logits spread out, so greedy choices are far apart
    # and float noise between engines cannot flip a token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny-llama: vocab {tok.get_vocab_size()}, {sum(p.numel() for p in model.parameters())} parameters -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
