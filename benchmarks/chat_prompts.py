"""Chat prompts for training and measuring draft heads offline: requests of many kinds
(explain, list, compare, write, advise, how-to, define, summarise) about many subjects, as JSON
lines (`{"prompt": ...}`, what `jaxllm train-draft --prompts` reads).

    .venv/bin/python benchmarks/chat_prompts.py --train FILE [--held-out FILE] [--n 600]

The held-out prompts share no subject and no request wording with the training ones, so a
head measured on them has seen neither.
"""

from __future__ import annotations

import argparse
import json
import random

SUBJECTS = """the ocean tides; volcanoes; bread baking; the game of chess; the phases of the moon;
bicycle maintenance; jazz music; honey bees; photosynthesis; the Roman Empire; black holes;
composting; the water cycle; electric cars; learning a second language; the human heart;
coffee brewing; the printing press; rainforests; machine learning; saving money; the stock
market; running a marathon; the French Revolution; earthquakes; recycling plastic; the solar
system; meditation; vaccines; the internet; climate change; dinosaurs; coral reefs; the Great
Wall of China; growing tomatoes; public speaking; time management; sleep; the immune system;
renewable energy; airplanes; the Olympic Games; chocolate; the Amazon river; glaciers;
friendship; writing a resume; job interviews; cloud computing; cryptography; the piano; soccer;
camping; desert animals; the Renaissance; penguins; hurricanes; the periodic table; gravity;
electricity at home; baking cookies; painting with watercolors; birds migrating; the history of
tea; smartphones; video games; the pyramids of Egypt; wolves; nutrition; drinking water;
city planning; trains; the Moon landing; origami; knitting; pizza; the violin; bees and
flowers; a healthy breakfast; robots; satellites; the human brain; rivers; mountains; wind
power; the library; museums; elephants; rabbits as pets; dogs; cats; goldfish; gardening in
spring; autumn leaves; snow; thunderstorms; the rainbow; sunsets; microscopes; telescopes;
the alphabet; prime numbers; fractions; geometry; the Pythagorean theorem; algebra; poetry;
fairy tales; Shakespeare; the Olympic swimming events; yoga; kindness; volunteering; budgeting
for a trip; packing for a holiday; learning to cook; making soup; the history of money; banks;
taxes; democracy; elections; the United Nations; first aid; fire safety; washing hands;
brushing teeth; recycling paper; electric guitars; drums; opera; ballet; movies; cartoons;
comic books; board games; puzzles; magic tricks; the circus; zoos; farms; cows; chickens;
apples; oranges; bananas; rice; wheat; potatoes; the Sahara desert; the Arctic; the Antarctic;
islands; lighthouses; bridges; tunnels; skyscrapers; castles; knights; pirates; explorers;
maps; compasses; clocks; calendars; the seasons; the sun; stars; comets; Mars; Jupiter""".replace(
    "\n", " "
)
SUBJECTS = [s.strip() for s in SUBJECTS.split(";") if s.strip()]

TEMPLATES = [
    "Explain {} to a ten-year-old.",
    "Give me three interesting facts about {}.",
    "Write a short poem about {}.",
    "What are the most important things to know about {}?",
    "Can you summarize the history of {} in a few sentences?",
    "Write a short story for children about {}.",
    "What are some common misconceptions about {}?",
    "List five questions a student might ask about {}.",
    "How would you teach a beginner about {}?",
    "Describe {} in one paragraph.",
    "Why is {} important?",
    "Write a haiku about {}.",
    "What is the best way to learn about {}?",
    "Give a simple definition of {}.",
    "Tell me a fun fact about {}.",
    "Write a tweet about {}.",
    "What would a scientist say about {}?",
    "Compare {} with something from everyday life.",
    "Write a short dialogue between two friends about {}.",
    "What are the pros and cons of {}?",
]
HELD_OUT_TEMPLATES = [
    "I am curious about {}. Where should I start?",
    "Please write a few sentences describing {} for a school report.",
    "What could go wrong with {}, and how can it be avoided?",
    "Imagine you are a tour guide. Talk about {}.",
    "Teach me something surprising about {}.",
]


def prompts(n: int, templates: list[str], subjects: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(t, s) for t in templates for s in subjects]
    rng.shuffle(pairs)
    return [t.format(s) for t, s in pairs[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", required=True)
    parser.add_argument("--held-out")
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--n-held-out", type=int, default=32)
    args = parser.parse_args()
    rng = random.Random(0)
    subjects = SUBJECTS[:]
    rng.shuffle(subjects)
    held_subjects, train_subjects = subjects[:20], subjects[20:]
    with open(args.train, "w") as f:
        for p in prompts(args.n, TEMPLATES, train_subjects, 1):
            f.write(json.dumps({"prompt": p}) + "\n")
    if args.held_out:
        with open(args.held_out, "w") as f:
            for p in prompts(args.n_held_out, HELD_OUT_TEMPLATES, held_subjects, 2):
                f.write(json.dumps({"prompt": p}) + "\n")


if __name__ == "__main__":
    main()
