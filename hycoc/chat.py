"""Gemma-style chat template shared by the toy family and the real Gemma 4 checkpoints.

``<bos><start_of_turn>user\\n{text}<end_of_turn>\\n<start_of_turn>model\\n`` opens a model turn; the model ends
its turn with ``<end_of_turn>``; a later user turn follows as ``\\n<start_of_turn>user\\n{text}<end_of_turn>\\n
<start_of_turn>model\\n`` (one ``<bos>`` per conversation). numpy-free and torch-free: the device runtime uses it too.
"""

from __future__ import annotations

BOS = "<bos>"
EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"
MASK = "<mask>"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
#: Special tokens in id order (ids 0..len-1 in the toy tokenizer).
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, MASK, START_OF_TURN, END_OF_TURN,
                  "<start_of_image>", "<end_of_image>", "<tool_call>", "<tool_response>", "<think>"]


def user_turn(text: str) -> str:
    """The prompt string for one user message, ending where the model's answer begins."""
    return f"{BOS}{START_OF_TURN}user\n{text}{END_OF_TURN}\n{START_OF_TURN}model\n"


def conversation(user: str, model: str) -> str:
    """A whole single-turn conversation as training text (the model turn closed by ``<end_of_turn>``)."""
    return f"{user_turn(user)}{model}{END_OF_TURN}\n"


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` read as plain text: a control-token string inside it (``<end_of_turn>``, ``<bos>``,
    ...) is spelled with ordinary tokens, never turned into the control token (tokenizers'
    ``encode_special_tokens``). tokenizer: a `tokenizers.Tokenizer`."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        tokenizer.encode_special_tokens = before


def _control(tokenizer, token: str) -> int:
    i = tokenizer.token_to_id(token)
    if i is None:
        raise ValueError(f"the tokenizer has no {token} token; the chat template needs it")
    return i


def format_prompt(tokenizer, user_text: str) -> list[int]:
    """Token ids of `user_turn(user_text)`, in which only the template adds control tokens: the user's text is
    encoded as text (`encode_text`), so a message containing ``<end_of_turn>`` or ``<start_of_turn>model`` cannot
    open or close a turn. For text without control-token strings the ids equal encoding the template string
    whole. tokenizer: a `tokenizers.Tokenizer`. Returns a list of int ids. Raises ValueError if the tokenizer
    lacks a control token of the template."""
    bos, sot, eot = (_control(tokenizer, t) for t in (BOS, START_OF_TURN, END_OF_TURN))
    return [bos, sot, *encode_text(tokenizer, f"user\n{user_text}"), eot, *encode_text(tokenizer, "\n"), sot,
            *encode_text(tokenizer, "model\n")]


def stop_token_ids(tokenizer) -> set[int]:
    """Ids that end a model turn: ``<end_of_turn>`` and ``<eos>`` (those the tokenizer has)."""
    ids = {tokenizer.token_to_id(t) for t in (END_OF_TURN, EOS)}
    return {i for i in ids if i is not None}


def next_user_turn(tokenizer, user_text: str, answer_closed: bool) -> list[int]:
    """Token ids that continue a conversation after the model's answer with the next user message, up to where
    the model's next answer begins: ``[<end_of_turn>]\\n<start_of_turn>user\\n{text}<end_of_turn>\\n<start_of_turn>
    model\\n``. answer_closed: whether the answer already ends with ``<end_of_turn>`` (else it is added: an answer
    cut by the output cap). The user's text is encoded as text (`encode_text`). tokenizer: a
    `tokenizers.Tokenizer`. Raises ValueError if the tokenizer lacks a control token of the template."""
    sot, eot = (_control(tokenizer, t) for t in (START_OF_TURN, END_OF_TURN))
    return [*([] if answer_closed else [eot]), *encode_text(tokenizer, "\n"), sot,
            *encode_text(tokenizer, f"user\n{user_text}"), eot, *encode_text(tokenizer, "\n"), sot,
            *encode_text(tokenizer, "model\n")]
