"""Regenerate ``corpus.jsonl``: private-looking sentences, all fictional, in four topics.

Run ``python -m aegis.data._make_corpus`` after editing the templates; the shipped jsonl is what
``aegis.data.load_corpus`` reads, so the package never needs this script at run time. Every name,
number, address and account below is invented; any resemblance to a real person is accidental.
Output is deterministic (fixed RNG seed) so the jsonl only changes when the templates do.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

PER_TOPIC = 100
VALIDATION_SHARE = 0.2
SEED = 20240611

FIRST = [
    "Maria", "Jonas", "Priya", "Tomasz", "Aisha", "Lukas", "Elena", "Omar", "Chloe", "Mateo", "Ingrid",
    "Kenji", "Fatima", "Nils", "Sofia", "Daniel", "Leila", "Viktor", "Hannah", "Rafael", "Amara", "Pieter",
    "Yuki", "Grace", "Emil", "Noor", "Carmen", "Felix", "Zara", "Malik",
]
LAST = [
    "Keller", "Okafor", "Lindqvist", "Moreau", "Novak", "Haddad", "Brennan", "Castillo", "Varga", "Tanaka",
    "Holm", "Rossi", "Achebe", "Petrov", "Duarte", "Whitfield", "Nakamura", "Ferreira", "Sandoval", "Ibsen",
]
CITY = ["Leeds", "Porto", "Graz", "Tampere", "Lyon", "Utrecht", "Bergen", "Cork", "Brno", "Malmo", "Basel"]
STREET = ["Elm Street", "Harbour Road", "Mill Lane", "Station Avenue", "Orchard Close", "Quay Street"]
MONTH = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]
DAY = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]

CONDITION = [
    "type 2 diabetes", "hypertension", "asthma", "migraine", "atrial fibrillation", "chronic kidney disease",
    "depression", "hypothyroidism", "COPD", "epilepsy", "psoriasis", "anaemia",
]
DRUG = [
    "metformin", "lisinopril", "salbutamol", "sertraline", "levothyroxine", "warfarin", "apixaban",
    "amoxicillin", "omeprazole", "atorvastatin", "prednisolone", "insulin glargine",
]
SYMPTOM = [
    "chest pain", "shortness of breath", "a persistent cough", "dizziness", "night sweats", "blurred vision",
    "swollen ankles", "abdominal pain", "palpitations", "a rash on both arms", "fatigue", "numbness in the left hand",
]
WARD = ["cardiology", "oncology", "maternity", "the emergency department", "neurology", "the renal unit"]
TEST = ["HbA1c", "ECG", "chest X-ray", "MRI scan", "blood panel", "biopsy", "ultrasound", "CT scan"]

PROJECT = ["the Q3 budget", "the merger draft", "the audit report", "the hiring plan", "the vendor contract",
           "the board slides", "the pricing review", "the product launch", "the security incident"]
CHAT_THING = ["dinner", "the concert", "football practice", "the dentist", "grandma's birthday", "the gym",
              "the party", "movie night", "the school play", "the flat viewing"]
BANK_THING = ["rent", "the car loan", "the mortgage", "council tax", "the electricity bill", "tuition fees",
              "the phone contract", "childcare", "the insurance premium"]
MERCHANT = ["Northwind Grocers", "Bluebird Travel", "Cedar Pharmacy", "Polar Electronics", "Harbor Fuel",
            "Lumen Books", "Kestrel Airlines", "Maple Hardware"]


def _templates() -> dict[str, list]:
    """Topic -> list of callables (rng -> sentence); each template fixes the sentence's shape."""
    return {
        "medical": [
            lambda r: f"Patient {_name(r)}, aged {r.randint(19, 88)}, was admitted with {r.choice(SYMPTOM)}.",
            lambda r: f"Diagnosis: {r.choice(CONDITION)}; started {r.choice(DRUG)} {r.choice([5, 10, 20, 40, 50])} mg daily.",
            lambda r: f"{_first(r)} reports {r.choice(SYMPTOM)} since {r.choice(DAY)} and poor sleep.",
            lambda r: f"Referral to {r.choice(WARD)} for {_name(r)}, NHS number {_digits(r, 3)} {_digits(r, 3)} {_digits(r, 4)}.",
            lambda r: f"The {r.choice(TEST)} on {r.randint(1, 28)} {r.choice(MONTH)} showed no sign of {r.choice(CONDITION)}.",
            lambda r: f"Patient is allergic to {r.choice(['penicillin', 'latex', 'peanuts', 'ibuprofen', 'codeine'])}.",
            lambda r: (
                f"{_name(r)}, born {r.randint(1, 28)} {r.choice(MONTH)} {r.randint(1936, 2004)}, of "
                f"{r.choice(STREET)}, was seen today for {r.choice(CONDITION)}."
            ),
            lambda r: (
                f"Handover: {_name(r)} on {' and '.join(r.sample(DRUG, 2))}; "
                f"family asked us not to share the results."
            ),
            lambda r: f"Mrs {r.choice(LAST)} missed her {r.choice(TEST)} appointment again.",
            lambda r: f"Blood pressure {r.randint(110, 180)}/{r.randint(65, 110)}, pulse {r.randint(55, 120)}, temperature {r.randint(36, 39)}.{r.randint(0, 9)}.",
            lambda r: f"Discharge summary: {_name(r)} recovered well after surgery and goes home on {r.choice(DAY)}.",
            lambda r: f"Please stop {r.choice(DRUG)} before the {r.choice(TEST)} next week.",
            lambda r: f"{_first(r)} is pregnant, {r.randint(8, 39)} weeks, with gestational {r.choice(['diabetes', 'hypertension'])}.",
            lambda r: f"History of {r.choice(CONDITION)} and {r.choice(CONDITION)}; smokes {r.randint(5, 30)} cigarettes a day.",
            lambda r: f"Therapy note: {_first(r)} talked about panic attacks at work and the divorce.",
            lambda r: f"Dose of {r.choice(DRUG)} increased after the fall at home in {r.choice(CITY)}.",
            lambda r: f"HIV test result for patient {_digits(r, 6)} is negative.",
            lambda r: f"Follow-up in {r.randint(2, 12)} weeks to review {r.choice(CONDITION)} and repeat the {r.choice(TEST)}.",
            lambda r: f"Dr {r.choice(LAST)} suspects early {r.choice(['dementia', 'Parkinson disease', 'multiple sclerosis', 'lymphoma'])}.",
            lambda r: f"Prescription renewed: {r.choice(DRUG)}, {r.randint(28, 90)} tablets, no repeats.",
            lambda r: f"The child was brought in by her father with {r.choice(SYMPTOM)} and a fever.",
            lambda r: f"{_name(r)} declined the flu vaccine and asked about {r.choice(DRUG)} side effects.",
            lambda r: f"Wound on the left knee cleaned and dressed; check again on {r.choice(DAY)}.",
            lambda r: f"Positive for {r.choice(['chlamydia', 'hepatitis C', 'tuberculosis', 'influenza A'])}; partner to be notified.",
            lambda r: f"Weight {r.randint(48, 130)} kg, BMI {r.randint(18, 41)}, advised to reduce alcohol.",
            lambda r: f"Urgent: {_name(r)} in bed {r.randint(1, 40)} has {r.choice(SYMPTOM)} after the new {r.choice(DRUG)} dose.",
            lambda r: f"Mental health review for {_first(r)}; no suicidal thoughts reported this month.",
        ],
        "email": [
            lambda r: f"Hi {_first(r)}, please find attached {r.choice(PROJECT)} before {r.choice(DAY)}.",
            lambda r: f"Dear {_first(r)}, your salary will rise to {r.randint(38, 140)} thousand from {r.choice(MONTH)}.",
            lambda r: f"Confidential: we plan to let {r.randint(3, 40)} people go after {r.choice(PROJECT)}.",
            lambda r: f"Can you send me the login for the shared drive? The password {_word(r)}{_digits(r, 3)} expired.",
            lambda r: f"{_first(r)}, the client in {r.choice(CITY)} rejected {r.choice(PROJECT)}, call me.",
            lambda r: f"Reminder: performance review with {_name(r)} on {r.choice(DAY)} at {r.randint(9, 17)}:00.",
            lambda r: f"I am resigning effective {r.randint(1, 28)} {r.choice(MONTH)}; please keep this quiet for now.",
            lambda r: f"My new address is {r.randint(2, 98)} {r.choice(STREET)}, {r.choice(CITY)}.",
            lambda r: f"Thanks {_first(r)}, the signed offer letter is in your inbox.",
            lambda r: f"Please do not forward: {r.choice(PROJECT)} numbers are worse than we told the board.",
            lambda r: f"Sick leave request for {_name(r)} from {r.choice(DAY)} to Friday, doctor's note attached.",
            lambda r: f"Invoice {_digits(r, 5)} for {r.randint(200, 9000)} euros is overdue by {r.randint(5, 60)} days.",
            lambda r: f"Hello team, the offsite in {r.choice(CITY)} is cancelled.",
            lambda r: f"{_first(r)} asked for parental leave starting in {r.choice(MONTH)}.",
            lambda r: f"Forwarding the complaint from {_name(r)} about harassment in the {r.choice(CITY)} office.",
            lambda r: f"Your interview for the analyst role is confirmed for {r.choice(DAY)} morning.",
            lambda r: f"Legal says we must settle with {_name(r)} before {r.choice(MONTH)} to avoid court.",
            lambda r: f"Could you review {r.choice(PROJECT)} tonight? I need it for the meeting with {_first(r)} tomorrow.",
            lambda r: f"The background check for {_name(r)} found an old fraud conviction.",
            lambda r: f"Per our call, the bonus pool this year is {r.randint(2, 15)} percent lower.",
            lambda r: f"Hi, my employee ID is {_digits(r, 6)} and I still cannot access payroll.",
            lambda r: f"Best regards, {_name(r)}, Head of Finance, {r.choice(CITY)}.",
            lambda r: f"Do not tell {_first(r)} yet, but the {r.choice(CITY)} branch closes in {r.choice(MONTH)}.",
            lambda r: "Attached are the medical records you requested for the insurance claim.",
            lambda r: f"Quick note: I will be late, {_first(r)} has the keys to the server room.",
            lambda r: (
                f"Hi {_first(r)}, sorry to confirm that your contract in {r.choice(CITY)} ends in {r.choice(MONTH)}; "
                f"HR will call you on {r.choice(DAY)}."
            ),
            lambda r: (
                f"Dear {_name(r)}, we regret to inform you that the visa sponsorship for your transfer to "
                f"{r.choice(CITY)} was refused because of a past conviction."
            ),
        ],
        "chat": [
            lambda r: f"hey {_first(r).lower()} are we still on for {r.choice(CHAT_THING)} tonight",
            lambda r: f"lol did you see what {_first(r)} posted about {_first(r)}",
            lambda r: f"cant come to {r.choice(CHAT_THING)}, feeling awful again",
            lambda r: f"my new number is 07{_digits(r, 3)} {_digits(r, 6)}, delete the old one",
            lambda r: "omg I think I'm pregnant, don't tell mum yet",
            lambda r: f"meet me at {r.choice(STREET)} at {r.randint(5, 11)} pm, bring the cash",
            lambda r: f"the wifi password is {_word(r)}{_digits(r, 4)} btw",
            lambda r: f"{_first(r)} broke up with me over text, I can't stop crying",
            lambda r: f"ok I sent you {r.randint(20, 400)} quid for {r.choice(CHAT_THING)}",
            lambda r: f"running late, stuck on the train to {r.choice(CITY)}",
            lambda r: "did you get the test results back? I'm so scared",
            lambda r: f"pls pick up the kids from {r.choice(CHAT_THING)} at {r.randint(3, 6)}",
            lambda r: f"I told my boss I was sick but I'm actually at {r.choice(CHAT_THING)}",
            lambda r: f"happy birthday {_first(r)}!! see you {r.choice(DAY).lower()}",
            lambda r: f"the door code for the flat is {_digits(r, 4)}, don't share it",
            lambda r: f"{_first(r)} got fired today and he's not ok",
            lambda r: f"can you lend me {r.randint(50, 900)} until payday, rent is due",
            lambda r: "I'm at the hospital with dad, it's his heart again",
            lambda r: f"who's coming to {r.choice(CHAT_THING)} on {r.choice(DAY).lower()}",
            lambda r: f"my therapist thinks I should move out of {r.choice(CITY)}",
            lambda r: f"just landed in {r.choice(CITY)}, call you from the hotel",
            lambda r: f"don't tell {_first(r)} about the surprise party",
            lambda r: f"I've been clean for {r.randint(2, 300)} days today",
            lambda r: f"the landlord wants us out by {r.randint(1, 28)} {r.choice(MONTH)}",
            lambda r: "yes I voted for them, no regrets",
            lambda r: (
                f"honestly {_first(r).lower()} I don't know how to tell mum I lost the job and can't pay "
                f"{r.choice(BANK_THING)}"
            ),
            lambda r: (
                f"ok so the plan is we meet at {r.randint(2, 98)} {r.choice(STREET)} at {r.randint(5, 11)}, "
                f"{_first(r).lower()} brings the car and nobody tells {_first(r).lower()} anything"
            ),
        ],
        "banking": [
            lambda r: f"Your account ending {_digits(r, 4)} was debited {r.randint(5, 3000)}.{_digits(r, 2)} EUR at {r.choice(MERCHANT)}.",
            lambda r: f"Transfer of {r.randint(100, 20000)} GBP to {_name(r)} completed.",
            lambda r: f"Your verification code is {_digits(r, 6)}. Never share it with anyone.",
            lambda r: f"Dear {_name(r)}, your loan application for {r.randint(5, 250)} thousand was declined.",
            lambda r: f"IBAN GB{_digits(r, 2)} NWBK {_digits(r, 4)} {_digits(r, 4)} {_digits(r, 4)} {_digits(r, 2)} added as a new payee.",
            lambda r: f"Payment for {r.choice(BANK_THING)} of {r.randint(40, 2500)} EUR failed: insufficient funds.",
            lambda r: f"Your balance is {r.randint(0, 90000)}.{_digits(r, 2)} GBP as of {r.randint(1, 28)} {r.choice(MONTH)}.",
            lambda r: f"Card ending {_digits(r, 4)} blocked after suspicious use in {r.choice(CITY)}.",
            lambda r: f"Direct debit to {r.choice(MERCHANT)} for {r.choice(BANK_THING)} set up.",
            lambda r: f"Overdraft limit raised to {r.randint(5, 50) * 100} GBP for {_name(r)}.",
            lambda r: f"Salary of {r.randint(1500, 9000)} EUR received from {r.choice(LAST)} Consulting.",
            lambda r: f"Mortgage arrears: {r.randint(2, 9)} missed payments on the house on {r.choice(STREET)}.",
            lambda r: f"Hi {_first(r)}, your credit score dropped to {r.randint(300, 850)} this month.",
            lambda r: f"Cash withdrawal of {r.randint(2, 50) * 10} EUR at {r.choice(CITY)} station, {r.randint(0, 23)}:{r.randint(0, 59):02d}.",
            lambda r: f"Refund of {r.randint(5, 700)}.{_digits(r, 2)} from {r.choice(MERCHANT)} credited.",
            lambda r: f"We noticed a login from a new device in {r.choice(CITY)}. Was this you?",
            lambda r: f"Standing order to {_name(r)} for {r.choice(BANK_THING)} cancelled.",
            lambda r: f"Sort code {_digits(r, 2)}-{_digits(r, 2)}-{_digits(r, 2)}, account {_digits(r, 8)}, name {_name(r)}.",
            lambda r: f"Your savings goal for {r.choice(BANK_THING)} is {r.randint(10, 95)} percent complete.",
            lambda r: f"Gambling transactions of {r.randint(100, 5000)} GBP flagged on account {_digits(r, 8)}.",
            lambda r: f"Debt collection notice: {r.randint(300, 15000)} EUR owed for {r.choice(BANK_THING)}.",
            lambda r: f"Pension contribution of {r.randint(100, 900)} GBP paid for {_name(r)}.",
            lambda r: f"Reminder: {r.choice(BANK_THING)} of {r.randint(50, 1500)} EUR is due on {r.choice(DAY)}.",
            lambda r: f"Foreign payment to {r.choice(CITY)} held for review; call us with reference {_digits(r, 7)}.",
            lambda r: f"PIN changed for the card ending {_digits(r, 4)}.",
            lambda r: (
                f"Dear {_name(r)}, after missed payments on {r.choice(BANK_THING)} your account is frozen and "
                f"{r.randint(300, 9000)} EUR will be recovered on {r.choice(DAY)}."
            ),
            lambda r: (
                f"Large transfer alert: {r.randint(10, 90)} thousand GBP sent from your joint account "
                f"to {_name(r)} in {r.choice(CITY)} at {r.randint(0, 23)}:{r.randint(0, 59):02d}."
            ),
        ],
    }


def _first(r: random.Random) -> str:
    return r.choice(FIRST)


def _name(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def _digits(r: random.Random, n: int) -> str:
    return "".join(str(r.randint(0, 9)) for _ in range(n))


def _word(r: random.Random) -> str:
    return r.choice(["sunflower", "tiger", "marble", "falcon", "copper", "velvet", "harbor", "maple"])


def make(rng: random.Random) -> list[dict]:
    rows = []
    for topic, templates in _templates().items():
        seen: set[str] = set()
        # Cycle through the templates so every shape appears before any repeats.
        order = list(range(len(templates)))
        i = 0
        while len(seen) < PER_TOPIC:
            if i % len(order) == 0:
                rng.shuffle(order)
            text = templates[order[i % len(order)]](rng)
            i += 1
            if text not in seen:
                seen.add(text)
                rows.append({"text": text, "label": topic})
    rng.shuffle(rows)
    # Stratified split: the first 20 % of each topic (in shuffled order) is validation.
    counts: dict[str, int] = {}
    for row in rows:
        k = counts[row["label"]] = counts.get(row["label"], 0) + 1
        row["split"] = "validation" if k <= PER_TOPIC * VALIDATION_SHARE else "train"
    return rows


def main() -> None:
    path = Path(__file__).with_name("corpus.jsonl")
    rows = make(random.Random(SEED))
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} sentences to {path}")


if __name__ == "__main__":
    main()
