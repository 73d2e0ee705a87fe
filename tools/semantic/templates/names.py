"""Given names the PII person recognizer knows (a closed list is what makes a capitalised word a name
rather than the start of a sentence), and surnames used only to generate data (surnames are an open
class: the recognizer takes any capitalised word after a known given name or a title)."""

from __future__ import annotations

FIRST_NAMES = frozenset("""
Aaron Abigail Adam Adrian Ahmed Aisha Alan Albert Alejandro Alex Alexander Alexandra Alice Alicia Amanda Amelia
Amir Amy Ana Andrea Andrew Angela Anna Anne Anthony Antonio Arjun Ashley Barbara Benjamin Beth Brandon Brian
Bruce Caleb Cameron Carl Carlos Carmen Caroline Catherine Charles Charlotte Chen Chloe Christina Christopher
Claire Claudia Connor Daniel Daniela David Deborah Dennis Diana Diego Dmitri Donald Dorothy Douglas Dylan Edward
Elena Elizabeth Ellen Emily Emma Eric Ethan Eva Evelyn Fatima Felix Fernando Fiona Frank Gabriel Gary George
Gloria Gregory Hannah Harold Harry Hassan Heather Helen Henry Hiroshi Hugo Ian Igor Irene Isaac Isabella Ivan
Jack Jacob James Jamie Jane Janet Jason Javier Jennifer Jeremy Jessica Joan John Jonathan Jorge Jose Joseph
Joshua Juan Julia Julian Justin Karen Katherine Keith Kenji Kevin Kimberly Kyle Laura Lauren Leah Leo Liam
Linda Lisa Logan Lucas Lucy Luis Luke Maria Marie Mario Marta Martin Mary Matthew Maya Megan Mei Melissa Mia
Michael Michelle Miguel Mohammed Monica Nancy Natalie Nathan Nicholas Nicole Nina Noah Olga Olivia Omar Oscar
Pablo Pamela Patricia Patrick Paul Paula Pedro Peter Philip Priya Rachel Rafael Rahul Rajesh Ramon Raymond
Rebecca Richard Robert Roberto Roger Ryan Samantha Samuel Sandra Sara Sarah Scott Sean Sergei Sharon Sofia
Sophia Stephanie Stephen Steven Susan Takeshi Tanya Teresa Thomas Timothy Tyler Valentina Vanessa Victor
Victoria Vincent Walter Wei William Xavier Yuki Zachary Zoe
""".split())

# Given names that are also common English words: only taken as a name with a surname or a title.
AMBIGUOUS_FIRST_NAMES = frozenset("Bill Grace Rose June May Will Mark Faith Hope Joy Art Max Summer Dawn".split())

SURNAMES_DEV = """Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Gonzalez
Wilson Anderson Taylor Moore Jackson Martin Lee Thompson White Harris Clark Lewis Robinson Walker Young Allen King
Wright Scott Hill Green Adams Baker Nelson Carter Mitchell Roberts""".split()

SURNAMES_TEST = """Okafor Nakamura Kowalski Lindqvist Ferreira Moreau Schneider Petrova Haddad Tanaka Novak Gallagher
Ivanova Rossi Dubois Fischer Jansen Kaur Mensah Oyelaran Sato Varga Weiss Zimmermann Abernathy Castellano
Delacroix Eriksen Fitzgerald Gunawardena""".split()
