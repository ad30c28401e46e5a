"""Re-prefilled tokens per turn of 3-turn conversations on the verifier engine (docs/serving.md "Conversations").

    python benchmarks/conversation_reprefill.py recipes/toy.toml --limit 8
    python benchmarks/conversation_reprefill.py recipes/toy.toml --template gemma4_large.jinja --thinking

For the first N two-turn Spec-Bench questions, a third user turn is added (`THIRD_TURN`); each conversation runs
Cloud+MTP (the server drafts: no device needed) on `hycoc.verifier.VerifierEngine`, and every next turn is the
whole conversation re-rendered by the template (`hycoc.chat.Conversation`) and continued on the same session
(`Session.continue_with`). Per turn it prints what the session held, what it kept, where the KV rolled back
(`AppendPlan`: crop, snapshot or full), the positions prefilled again that the session held already, the new ids,
and the bound: the ids after the previous model turn's opening (the last answer and the new user turn). --template
renders with another chat template file (e.g. a Gemma 4 template with the toy's tokenizer), as a real checkpoint's
folder would give it. Exits 1 when any turn prefilled more than its bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine_setup import add_engine_args, open_cloud_mtp, run_rounds, setup_engine

#: The third user turn of every conversation.
THIRD_TURN = "Now summarize your answers in two sentences."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, limit_help="first N two-turn questions", cap_help="per turn (default: the recipe's)")
    ap.add_argument("--template", type=Path, default=None, help="a chat template file to render with instead")
    ap.add_argument("--thinking", action="store_true", help="render with enable_thinking=True")
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.chat import Chat, Conversation, template_digest

    setup = setup_engine(args)
    chat = setup.chat
    if args.template is not None:
        text = args.template.read_text(encoding="utf-8")
        chat = Chat(
            chat.format.model_copy(
                update={
                    "template": text,
                    "template_sha256": template_digest(text),
                    "has_thinking": True,
                    "sources": {**chat.format.sources, "template": str(args.template)},
                }
            ),
            chat.tokenizer,
        )
    table = Table(
        title=f"3-turn conversations, Cloud+MTP on {args.recipe.name} ({chat.format.sources['template']}, "
        f"thinking {'on' if args.thinking else 'off'}): what each next turn prefills"
    )
    for col in ("qid", "turn", "held", "kept", "rollback", "from", "re-prefilled", "new", "bound", "ok"):
        table.add_column(col, justify="right")
    over, turns, total_re, total_new = 0, 0, 0, 0
    questions = [q for q in load_spec_bench(args.dataset) if len(q.turns) > 1][: args.limit]
    for q in questions:
        conv = Conversation(chat, args.thinking)
        rendered = conv.ask(q.turns[0])
        sess = open_cloud_mtp(setup, rendered.ids, anchor=rendered.anchor)
        sess.prefill()
        run_rounds(sess)
        for n, user in enumerate((q.turns[1], THIRD_TURN), start=2):
            conv.answered(rendered, sess.tokens[len(rendered.ids) :])
            previous = rendered
            rendered = conv.ask(user)
            held = len(sess.tokens)
            sess.continue_with(rendered.ids, setup.cap, anchor=rendered.anchor)
            plan = sess.appends[-1]
            new = len(rendered.ids) - plan.keep
            bound = len(rendered.ids) - previous.anchor
            ok = plan.reprefilled + new <= bound
            over += not ok
            turns += 1
            total_re += plan.reprefilled
            total_new += new
            table.add_row(
                str(q.question_id),
                str(n),
                str(held),
                str(plan.keep),
                plan.kind,
                str(plan.start),
                str(plan.reprefilled),
                str(new),
                str(bound),
                "yes" if ok else "NO",
            )
            run_rounds(sess)
        sess.close()
    Console(width=120).print(table)
    print(f"{turns} next turns: {total_re} positions prefilled again, {total_new} new; {over} over the bound")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
