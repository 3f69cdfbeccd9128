"""Helpers of the command-line tests: stand-ins that fail a test when the CLI does work it should
have refused before, and the check of a one-line error."""
import textwrap

# Python source for a child process (argv: OUT SEED fast|slow): with "slow", every tensor written to
# a checkpoint prints "writing NAME" and pauses, so a test can signal the process midway through.
SLOW_WRITES = textwrap.dedent("""
    import sys, time
    from lowbit.io import st_format
    add = st_format.ShardedWriter.add
    def slow_add(self, name, t):
        add(self, name, t)
        print("writing", name, flush=True)
        time.sleep(0.2)
    if sys.argv[3] == "slow":
        st_format.ShardedWriter.add = slow_add
""")


def no_model(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")


def no_texts(*a, **k):
    raise AssertionError("calibration text was prepared before the plan was checked")


def one_line_error(capsys, *words, prefix: str = "lowbit "):
    """The last stderr line, asserted to be the CLI's one-line error (no traceback) starting with
    `prefix` and holding every one of `words`."""
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(prefix), err
    for w in words:
        assert w in last, last
    return last


def save_tokenizer(d, chat_template=None):
    """A real transformers tokenizer (one id per printable ASCII character, < 128) saved into `d`,
    with `chat_template` when given: a Hugging Face model folder's tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "[UNK]": 0}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    tok.chat_template = chat_template
    tok.save_pretrained(d)
    return tok
