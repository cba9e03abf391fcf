"""Tests for model.py: tokenizer + chat format and checkpoints (the engine: tests/test_engine.py)."""
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as model_lib  # noqa: E402
from chat_tokens import ASSISTANT_PREFIX  # noqa: E402
import r3  # noqa: E402

torch.set_num_threads(2)
TEXTS = [f"run `ls -la /app/dir{i}` then cat notes{i}.txt | grep -c error > count.txt" for i in range(30)] + \
        ['{"analysis": "the file exists", "plan": "sort it", "commands": [], "task_complete": true}'] * 5
CONVERSATION = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "count the errors in notes3.txt"},
    {"role": "assistant", "content": '{"analysis": "x", "plan": "grep -c error notes3.txt"}'},
    {"role": "user", "content": "$ grep -c error notes3.txt\n4\n"},
]


def prompt(tok, text):
    return model_lib.render_ids(tok, "user", text) + tok.encode(ASSISTANT_PREFIX)


# --- tokenizer and chat format --------------------------------------------------------------------
def test_tokenizer_training_is_deterministic_with_chatml_specials(tok):
    again = model_lib.train_tokenizer(TEXTS, vocab_size=400)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and 300 <= len(tok) <= 400
    text = "ünïcode → bytes\tand\nnewlines"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless


def test_render_ids_concatenated_equals_apply_chat_template(tok):
    ours = [i for m in CONVERSATION for i in model_lib.render_ids(tok, m["role"], m["content"])]
    ours += tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
    theirs = tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours == list(theirs)
    msg = model_lib.render_ids(tok, "assistant", "done")
    assert msg[0] == 1 and msg[-2:] == [2, tok.encode("\n")[0]]
    with pytest.raises(ValueError, match="role"):
        model_lib.render_ids(tok, "tool", "x")


def test_checkpoint_round_trip_loads_with_plain_hugging_face(tok, ckpt):
    actor = model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0).eval()
    ids = torch.tensor([prompt(tok, "list files")])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    plain = Qwen3_5MoeForCausalLM.from_pretrained(ckpt).eval()  # no r3: state-dict keys are HF's
    loaded, tok2 = model_lib.load_actor(ckpt)
    with torch.no_grad():
        want = actor(ids).logits
        assert torch.equal(plain(ids).logits, want)
        assert torch.equal(loaded.eval()(ids).logits, want)
    assert len(r3.routers(loaded)) == 4 and plain.config.router_aux_loss_coef == 0.0
    assert AutoTokenizer.from_pretrained(ckpt).backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert (tok2.apply_chat_template(CONVERSATION, tokenize=False)
            == tok.apply_chat_template(CONVERSATION, tokenize=False))
