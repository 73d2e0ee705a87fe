"""Held-out prompts of the three user-defined categories of issue 29 (`DEV_CATEGORIES`, tools/semantic/layer_dev.py).

Written by hand apart from the development set that chose `semantic.classifier.custom_threshold` and its slope,
and never used for a choice: what they give is a held-out figure (`bench.semantic`, "custom categories"), which
`tests/test_semantic_custom.py` also checks. They are few and written by the same project as the development set,
so their interval is wide and they say nothing about categories of another kind.
"""

from __future__ import annotations

HELD_OUT = [
    ("cooking", "How much yeast do I need for a pizza dough?"),
    ("cooking", "What's the difference between baking soda and baking powder?"),
    ("cooking", "How do I poach an egg without it falling apart?"),
    ("cooking", "Can you suggest a marinade for grilled tofu?"),
    ("cooking", "My soup is too salty, how can I fix it?"),
    ("cooking", "How long do I boil potatoes for mashed potatoes?"),
    ("cooking", "What's a good side dish for roast lamb?"),
    ("cooking", "How do I make my cookies chewy instead of crispy?"),
    ("cooking", "Which oil is best for deep frying?"),
    ("cooking", "Give me a recipe for a simple tomato sauce."),
    ("travel", "What are the must-see sights in Istanbul?"),
    ("travel", "Is it better to take the train or fly from Paris to Amsterdam?"),
    ("travel", "How much should I budget per day for backpacking in Vietnam?"),
    ("travel", "Can I use my EU driving licence to rent a car in the USA?"),
    ("travel", "What's the best season to see the northern lights in Norway?"),
    ("travel", "Which hotels near Times Square are family friendly?"),
    ("travel", "How do I get from Tokyo Narita airport to Shinjuku?"),
    ("travel", "Suggest a two-week road trip route through New Zealand."),
    ("travel", "Do I need vaccinations before travelling to Kenya?"),
    ("travel", "Are there direct flights from London to Cape Town?"),
    ("customer_support", "My parcel was marked delivered but I never got it."),
    ("customer_support", "I'd like a refund, the headphones I ordered are faulty."),
    ("customer_support", "How do I stop my subscription from renewing automatically?"),
    ("customer_support", "I got an invoice for a plan I never signed up for."),
    ("customer_support", "The item in my order is missing a part, what should I do?"),
    ("customer_support", "Can I get my money back if I cancel within 14 days?"),
    ("customer_support", "My account was locked after too many login attempts."),
    ("customer_support", "Your app keeps charging me even though I deleted my account."),
    ("customer_support", "When will my backordered item ship?"),
    ("customer_support", "I need to change the email address on my account."),
]

# prompts of the built-in categories: the head keeps them (a custom category must not swallow them)
BUILT_IN = [
    ("math", "Find the integral of 3x^2 + 2x from 0 to 1."),
    ("biology", "How do mitochondria produce energy in a cell?"),
    ("history", "Why did the Roman Empire fall?"),
    ("law", "What is the difference between a misdemeanor and a felony?"),
    ("physics", "What is the kinetic energy of a 2 kg mass moving at 3 m/s?"),
    ("computer science", "What is the time complexity of binary search?"),
    ("chemistry", "What is the pH of a 0.01 M hydrochloric acid solution?"),
    ("economics", "What is the difference between fiscal and monetary policy?"),
    ("philosophy", "What is Descartes' argument 'I think, therefore I am'?"),
    ("psychology", "What is cognitive dissonance?"),
]
