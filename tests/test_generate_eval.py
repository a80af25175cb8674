"""`megascale generate` and `megascale eval` on a checkpoint saved by dp2 x tp2, and the Hugging Face export's
tokenizer: sampling is seeded and the same from the checkpoint and from its one-process reshard, eval's
loss is the trainer's validation loss, and the exported folder generates from a text prompt in
transformers as megascale does. Both verify the checkpoint they load as a resume does: past a damaged
newest one to the previous one, with a warning; refused in one line when none is sound, or when the one
named is damaged."""

import io
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.checkpointer import list_checkpoints, write_checkpoint
from megascale.checkpoint.stateful import ModelState
from megascale.cli import main
from megascale.config import load_config, to_dict
from megascale.convert import load_trained
from megascale.data.tokenizer import ByteTokenizer, train_bpe
from megascale.errors import ConfigError
from megascale.evaluate import evaluate, token_bytes
from megascale.generate import generate, next_token, sample
from megascale.observe.metrics import read_metrics
from megascale.trainer import Trainer
from tests.conftest import tiny_args, train_processes

pytestmark = pytest.mark.xdist_group("generate_eval")  # one worker runs them all: its trained runs once

STEPS = 4


@pytest.fixture(scope="module")
def dp2_tp2_run(tiny_corpus, tmp_path_factory):
    """A tiny run trained by 4 processes (dp_shard 2 x tp 2), validated at its last step."""
    tmp_path = tmp_path_factory.mktemp("dp2tp2")
    extra = [
        "--parallel.dp_shard=2",
        "--parallel.tp=2",
        f"--training.steps={STEPS}",
        f"--training.val_every={STEPS}",
    ]
    return train_processes(4, tiny_corpus, tmp_path, *extra)


def _resharded(run, out):
    """The run's final checkpoint as one process saves it: the reshard a one-process job would load."""
    trained = load_trained(run)
    write_checkpoint(
        str(out), {"model": ModelState(trained.model)}, {"step": STEPS, "config": to_dict(trained.job)}
    )
    return out


def test_sampling_is_seeded_and_the_same_from_a_checkpoint_and_its_one_process_reshard(dp2_tp2_run, tmp_path):
    texts = [
        generate(source, "def ", max_new_tokens=40, seed=seed, top_k=20, top_p=0.9, out=io.StringIO())
        for source in (dp2_tp2_run, _resharded(dp2_tp2_run, tmp_path / "one"))
        for seed in (7, 7, 8)
    ]
    assert texts[0] == texts[1] == texts[3] == texts[4]
    assert texts[2] == texts[5] != texts[0]  # another seed, another text
    assert len(texts[0]) > 0


def test_the_stream_is_the_returned_text_after_the_prompt(dp2_tp2_run):
    out = io.StringIO()
    text = generate(dp2_tp2_run, "import ", max_new_tokens=30, temperature=0, out=out)
    assert out.getvalue() == "import " + text + "\n"


def test_next_token_keeps_to_the_likeliest_it_is_allowed():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 0, 1.0, generator) == 1  # greedy
    drawn = {next_token(logits, 1.0, 2, 1.0, generator) for _ in range(200)}
    assert drawn == {1, 2}  # top-k 2
    assert {next_token(logits, 5.0, 0, 0.05, generator) for _ in range(50)} == {1}  # top-p below the first
    assert len({next_token(logits, 5.0, 0, 1.0, generator) for _ in range(400)}) == 5


def test_eval_gives_the_trainers_validation_loss_and_its_bits_per_byte(dp2_tp2_run, tmp_path):
    logged = [record["val_loss"] for record in read_metrics(dp2_tp2_run) if "val_loss" in record]
    score = evaluate(dp2_tp2_run)
    assert abs(score.loss - logged[-1]) < 1e-5, (score.loss, logged[-1])
    # The byte tokenizer: every token a byte but the end of document, which counts none.
    assert score.bytes <= score.tokens
    assert score.bits_per_byte == pytest.approx(score.loss * score.tokens / math.log(2) / score.bytes)
    assert main(["eval", str(dp2_tp2_run), "--sequences", "0", "--out", str(tmp_path / "eval.json")]) == 0
    whole = json.loads((tmp_path / "eval.json").read_text())
    assert whole["sequences"] > score.sequences and whole["perplexity"] == pytest.approx(
        math.exp(whole["loss"])
    )


def test_token_bytes_are_the_utf8_bytes_of_the_text_encoded():
    text = "def héllo():\n    return 'wörld' * 2  # ünïcode"
    bpe = train_bpe([text * 3, "other text, other bytes"], vocab_size=300)
    for tokenizer in (ByteTokenizer(), bpe):
        ids = tokenizer.encode(text) + [tokenizer.eos_id]
        assert int(token_bytes(tokenizer)[ids].sum()) == len(text.encode())


def test_the_export_carries_the_tokenizer_and_generates_from_a_text_prompt_as_megascale_does(
    dp2_tp2_run, tmp_path
):
    transformers = pytest.importorskip("transformers")
    assert main(["convert", "--to", "hf", str(dp2_tp2_run), str(tmp_path / "hf")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = "def héllo"
    encoded = tokenizer(prompt, return_tensors="pt")
    assert encoded.input_ids[0].tolist() == [256, *prompt.encode()]  # a document begins after EOS
    assert (model.config.bos_token_id, model.config.eos_token_id) == (256, 256)
    theirs = model.generate(**encoded, max_new_tokens=20, do_sample=False)[0, encoded.input_ids.shape[1] :]
    ours = list(
        sample(
            load_trained(dp2_tp2_run).model,
            encoded.input_ids[0].tolist(),
            max_new_tokens=20,
            eos_id=256,
            temperature=0,
        )
    )
    assert theirs.tolist()[: len(ours)] == ours
    assert tokenizer.decode(theirs) == ByteTokenizer().decode(ours)


def test_generate_refuses_what_it_cannot_do(dp2_tp2_run, tmp_path):
    with pytest.raises(ConfigError, match="need temperature >= 0"):
        generate(dp2_tp2_run, temperature=-1, out=io.StringIO())
    assert main(["convert", "--to", "hf", str(dp2_tp2_run), str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    with pytest.raises(ConfigError, match="records no dataset .* --tokenizer"):
        generate(tmp_path / "imported", out=io.StringIO())
    assert generate(tmp_path / "imported", max_new_tokens=5, tokenizer="byte", out=io.StringIO()) is not None


@pytest.fixture(scope="module")
def one_process_run(tiny_corpus, tmp_path_factory):
    """A tiny run of one process with checkpoints at steps 3 and 6."""
    tmp_path = tmp_path_factory.mktemp("one")
    logger = logging.getLogger("megascale")
    handlers, propagate = list(logger.handlers), logger.propagate
    Trainer(load_config(None, tiny_args(tiny_corpus, tmp_path / "run", tmp_path / "data"))).train()
    for handler in set(logger.handlers) - set(handlers):  # the run's log: the tests' own records go to caplog
        handler.close()
    logger.handlers[:], logger.propagate = handlers, propagate
    return tmp_path / "run"


def _damage(checkpoint: str, how: str) -> None:
    shard = next(path for path in Path(checkpoint).iterdir() if path.suffix == ".distcp")
    content = shard.read_bytes()
    middle = len(content) // 2
    if how == "truncated":
        shard.write_bytes(content[:middle])
    else:  # one byte flipped: the size is right, the CRC-32 is not
        shard.write_bytes(content[:middle] + bytes([content[middle] ^ 0xFF]) + content[middle + 1 :])


COMMANDS = {
    "generate": ["generate", "--max-new-tokens", "4", "--prompt", "def "],
    "eval": ["eval", "--sequences", "2"],
}


@pytest.mark.parametrize("verb", COMMANDS)
@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_one_line_warning(
    one_process_run, tmp_path, caplog, verb, how
):
    run = Path(shutil.copytree(one_process_run, tmp_path / "run"))
    (_, previous), (_, newest) = list_checkpoints(str(run / "checkpoints"))
    _damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="megascale"):
        assert main([COMMANDS[verb][0], str(run), *COMMANDS[verb][1:]]) == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"step 6 at {newest} failed verification" in warnings[0]
    assert warnings[0].endswith("; trying the previous one")
    assert load_trained(run).checkpoint == previous


@pytest.mark.parametrize("verb", COMMANDS)
def test_a_run_with_no_sound_checkpoint_or_a_damaged_one_named_is_refused_in_one_line(
    one_process_run, tmp_path, capfd, verb
):
    run = Path(shutil.copytree(one_process_run, tmp_path / "run"))
    (_, previous), (_, newest) = list_checkpoints(str(run / "checkpoints"))
    _damage(newest, "flipped")
    assert main([COMMANDS[verb][0], newest, *COMMANDS[verb][1:]]) == 2
    error = capfd.readouterr().err.strip()
    assert error.count("\n") == 0
    assert error.startswith(
        f"error: checkpoint: {newest} failed verification (file __0_0.distcp fails its CRC"
    )
    _damage(previous, "truncated")
    assert main([COMMANDS[verb][0], str(run), *COMMANDS[verb][1:]]) == 2
    error = capfd.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        f"error: checkpoint: every checkpoint under {run / 'checkpoints'} failed verification"
    )
