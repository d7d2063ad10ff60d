"""Compose calib_generated.txt: varied calibration text from templates and word lists.

Deterministic (fixed seed, no third-party text). Run from anywhere:
    python mlx_dq/data/compose_calibration.py
It rewrites calib_generated.txt beside this file. Genres: worked math, tables and
lists, chat dialogue, short reports, logs and configuration, non-English notes.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path

SEED = 20261129
OUT = Path(__file__).with_name("calib_generated.txt")

FIRST = ["Amara", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kalani",
         "Luis", "Mei", "Nikhil", "Olga", "Priya", "Quentin", "Rosa", "Sami", "Tomasz", "Uma", "Viktor",
         "Wanjiru", "Xavier", "Yusuf", "Zofia", "Aiko", "Bruno", "Carmen", "Dmitri", "Esther", "Felix"]
LAST = ["Okafor", "Lindqvist", "Wei", "Haddad", "Nwosu", "Rahman", "Petrovic", "Sato", "Novak", "Park",
        "Kahale", "Moreno", "Lin", "Iyer", "Sokolova", "Sharma", "Dubois", "Ferreira", "Aziz", "Kowalski",
        "Menon", "Horvath", "Mwangi", "Laurent", "Demir", "Zielinska", "Tanaka", "Costa", "Ruiz", "Volkov"]
TOWNS = ["Harrowgate", "Port Elwin", "Marrowby", "Lindenfeld", "Saltcombe", "Ostrava Nova", "Cedar Falls",
         "Brackenridge", "Thornwick", "Valmora", "Kestrel Bay", "Ashford Mill", "Riverside", "Dunmore",
         "Greywater", "Sunnhollow", "Elmstead", "Norrby", "Castelvecchio", "Winterbourne"]
ITEMS = [("notebook", 3.40), ("pencil", 0.85), ("backpack", 27.50), ("water bottle", 9.99),
         ("calculator", 14.25), ("desk lamp", 22.00), ("stapler", 6.75), ("ruler", 1.20),
         ("mug", 7.40), ("umbrella", 12.90), ("headphones", 39.00), ("keyboard", 45.60)]
FRUITS = ["apples", "pears", "oranges", "plums", "lemons", "mangoes", "apricots", "figs", "cherries"]
TEAMS = ["Harbor Hawks", "Mill Street Rovers", "Northside Comets", "Valley Foxes", "Riverside Owls",
         "Ironbridge United", "Saltcombe Seals", "Cedar Falls Pioneers", "Thornwick Athletic", "Kestrel Bay Wanderers"]
COMPANIES = ["Larkspur Instruments", "Bluefen Logistics", "Copperleaf Foods", "Nimbus Grid", "Orchard Lane Software",
             "Tidewater Ceramics", "Greystone Robotics", "Meridian Textiles", "Quillfeather Press", "Sundial Energy"]
WEATHER = ["light rain", "heavy showers", "clear skies", "scattered clouds", "dense fog", "a thunderstorm",
           "steady drizzle", "bright sunshine", "gusty winds", "sleet", "patchy frost", "humid haze"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
SERVICES = ["auth-gateway", "billing-worker", "search-indexer", "media-transcoder", "inventory-api",
            "notification-hub", "report-builder", "session-cache"]
LEVELS = ["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"]
TOPICS_CHAT = [
    ("How do I keep basil alive indoors?",
     ["Give it the brightest window you have, ideally six hours of sun.",
      "Water when the top centimetre of soil is dry, not on a fixed schedule.",
      "Pinch off the flower buds so the plant keeps making leaves.",
      "Use a pot with a drainage hole; basil hates standing water."]),
    ("What's the difference between a list and a tuple in Python?",
     ["A list is mutable: you can append, remove and reorder items after creating it.",
      "A tuple is immutable, so it can be used as a dictionary key or a set member.",
      "Tuples are a natural fit for fixed records, like a pair of coordinates.",
      "Lists suit collections that grow, such as results gathered in a loop."]),
    ("Can you explain what compound interest is?",
     ["Compound interest is interest earned on both the original sum and the interest already added.",
      "With a yearly rate r, a balance P grows to P(1 + r)^n after n years.",
      "The more often interest is compounded, the faster the balance grows, up to a limit.",
      "That is why small differences in rate matter a lot over decades."]),
    ("My bike chain keeps slipping. Any ideas?",
     ["A worn chain is the usual cause; a chain checker tool will tell you in seconds.",
      "If the chain is fine, the rear derailleur may need its cable tension adjusted.",
      "Worn cassette teeth look like shark fins and also cause slipping under load.",
      "Clean and lubricate the drivetrain before adjusting anything else."]),
    ("How should I prepare for a job interview?",
     ["Read about the company's products and recent news so you can ask informed questions.",
      "Prepare three short stories about problems you solved and what you learned.",
      "Practise answering out loud; it feels different from rehearsing in your head.",
      "Plan your route or test your video setup the day before."]),
    ("Why is the sky blue?",
     ["Sunlight contains all visible colours, and air molecules scatter short wavelengths more strongly.",
      "Blue light is scattered across the whole sky, so it reaches your eyes from every direction.",
      "At sunset the light crosses more air, most blue is scattered away, and reds dominate.",
      "Violet is scattered even more, but our eyes are less sensitive to it."]),
    ("What is a good way to learn a new language?",
     ["Short daily practice beats long weekly sessions, because memory needs repetition.",
      "Learn the thousand most common words first; they cover most everyday speech.",
      "Listen to native speakers early, even before you understand everything.",
      "Find a conversation partner and accept that mistakes are part of the process."]),
    ("How do I undo my last git commit?",
     ["If you have not pushed it, `git reset --soft HEAD~1` removes the commit and keeps the changes staged.",
      "If it is already shared, `git revert HEAD` creates a new commit that undoes it safely.",
      "Use `git log --oneline` first to be sure which commit you are about to undo.",
      "Avoid rewriting history on branches other people have pulled."]),
    ("Is it better to rent or buy a home?",
     ["It depends on how long you plan to stay; buying usually pays off only over several years.",
      "Compare the full monthly cost of owning, including taxes, insurance and repairs, with rent.",
      "Renting keeps your savings liquid and makes moving for work much easier.",
      "Buying builds equity, but a down payment also has an opportunity cost."]),
    ("How much water should I drink each day?",
     ["Needs vary with body size, climate and activity, so there is no single number.",
      "A practical guide is to drink when thirsty and check that your urine is pale.",
      "Food supplies a good share of daily water, especially fruit and vegetables.",
      "During long exercise in heat, replace salt as well as water."]),
]
FR = ["Le marché de {town} ouvre à {h} heures chaque {jour}.", "Il a plu toute la matinée, puis le soleil est revenu vers midi.",
      "{name} a acheté {n} kilos de {fruit_fr} pour la fête du quartier.", "Le train pour Lyon partira avec {m} minutes de retard.",
      "Nous avons visité le musée, puis nous avons dîné près du port.", "La réunion est reportée à jeudi prochain, à {h} h {mm}."]
DE = ["Der Zug nach {town} fährt um {h}:{mm} Uhr von Gleis {g} ab.", "{name} hat gestern {n} Seiten seines Romans geschrieben.",
      "Bitte schließen Sie das Fenster, bevor Sie das Büro verlassen.", "Die Temperatur fiel in der Nacht auf {t} Grad.",
      "Wir treffen uns am {jour_de} vor der Bibliothek.", "Das Konzert war ausverkauft, aber wir haben noch Karten bekommen."]
ES = ["El autobús número {g} llega a la plaza cada {m} minutos.", "{name} preparó una paella para {n} personas.",
      "Mañana habrá {weather_es} en la costa norte.", "La biblioteca cierra a las {h} de la tarde los {jour_es}.",
      "Compramos pan, queso y {fruit_es} en el mercado.", "El partido terminó empatado después de la prórroga."]
FRUIT_FR = ["pommes", "poires", "prunes", "cerises", "abricots"]
FRUIT_ES = ["naranjas", "manzanas", "uvas", "higos", "limones"]
JOUR_FR = ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi"]
JOUR_DE = ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag"]
JOUR_ES = ["lunes", "martes", "miércoles", "jueves", "viernes", "sábados"]
WEATHER_ES = ["lluvia", "niebla", "viento fuerte", "sol", "tormentas"]


def person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def linear_equation(r: random.Random) -> str:
    a, x, b = r.randint(2, 12), r.randint(-9, 15), r.randint(-30, 30)
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    step = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    return (f"Problem: Solve {a}x {sign} {abs(b)} = {c}.\n"
            f"Solution: {step}: {a}x = {c - b}. Divide by {a}: x = {x}.\n"
            f"Check: {a}*({x}) {sign} {abs(b)} = {a * x} {sign} {abs(b)} = {c}. Correct.\n")


def word_problem(r: random.Random) -> str:
    name = r.choice(FIRST)
    kind = r.randrange(4)
    if kind == 0:
        item, price = r.choice(ITEMS)
        n = r.randint(2, 9)
        paid = math.ceil(n * price / 10) * 10 + r.choice([0, 10, 20])
        cost = round(n * price, 2)
        return (f"{name} buys {n} of the same {item} at ${price:.2f} each and pays with ${paid}. "
                f"How much change does {name} get?\n"
                f"The total is {n} x {price:.2f} = {cost:.2f} dollars, so the change is "
                f"{paid} - {cost:.2f} = {paid - cost:.2f} dollars.\n")
    if kind == 1:
        speed, hours = r.randint(35, 110), r.choice([1.5, 2, 2.5, 3, 4, 0.75])
        return (f"A car travels at a steady {speed} km/h for {hours} hours. How far does it go?\n"
                f"Distance = speed x time = {speed} x {hours} = {speed * hours:g} km.\n")
    if kind == 2:
        total, pct = r.randint(40, 900), r.choice([5, 10, 12, 15, 20, 25, 30, 40])
        return (f"A jacket costs ${total}. It is on sale for {pct}% off. What is the sale price?\n"
                f"The discount is {pct}/100 x {total} = {total * pct / 100:g}, so the price is "
                f"{total} - {total * pct / 100:g} = {total * (100 - pct) / 100:g} dollars.\n")
    fruit = r.choice(FRUITS)
    boxes, per = r.randint(3, 14), r.randint(6, 24)
    eaten = r.randint(1, boxes * per // 3)
    return (f"{name} has {boxes} boxes with {per} {fruit} in each and gives away {eaten}. How many are left?\n"
            f"{boxes} x {per} = {boxes * per}; {boxes * per} - {eaten} = {boxes * per - eaten} {fruit} remain.\n")


def fractions(r: random.Random) -> str:
    a, b = Fraction(r.randint(1, 9), r.randint(2, 12)), Fraction(r.randint(1, 9), r.randint(2, 12))
    op = r.choice(["+", "-", "*"])
    res = a + b if op == "+" else a - b if op == "-" else a * b
    return f"Compute {a} {op} {b}. Using a common denominator where needed, the result is {res} (about {float(res):.4f}).\n"


def derivative(r: random.Random) -> str:
    coeffs = [r.randint(-7, 9) for _ in range(r.randint(3, 5))]
    deg = len(coeffs) - 1

    def poly(cs: list[int], d: int) -> str:
        parts = []
        for i, c in enumerate(cs):
            p = d - i
            if c == 0:
                continue
            k = "" if c == 1 and p else ("-" if c == -1 and p else str(c))
            term = k if p == 0 else (f"{k}x" if p == 1 else f"{k}x^{p}")
            parts.append(term)
        return " + ".join(parts).replace("+ -", "- ") or "0"

    dcs = [c * (deg - i) for i, c in enumerate(coeffs[:-1])]
    x0 = r.randint(-3, 4)
    val = sum(c * x0 ** (deg - 1 - i) for i, c in enumerate(dcs))
    return (f"Let f(x) = {poly(coeffs, deg)}. By the power rule, f'(x) = {poly(dcs, deg - 1)}. "
            f"At x = {x0}, the slope is f'({x0}) = {val}.\n")


def gcd_steps(r: random.Random) -> str:
    a, b = r.randint(100, 5000), r.randint(30, 900)
    lines = [f"Find gcd({a}, {b}) with the Euclidean algorithm:"]
    x, y = max(a, b), min(a, b)
    while y:
        q, rem = divmod(x, y)
        lines.append(f"  {x} = {q} * {y} + {rem}")
        x, y = y, rem
    lines.append(f"The last non-zero remainder is {x}, so gcd({a}, {b}) = {x}.")
    return "\n".join(lines) + "\n"


def factorize(r: random.Random) -> str:
    n = r.randint(60, 20000)
    m, f, fs = n, 2, []
    while f * f <= m:
        while m % f == 0:
            fs.append(f)
            m //= f
        f += 1
    if m > 1:
        fs.append(m)
    return f"Prime factorization: {n} = {' x '.join(map(str, fs))}.\n"


def matrix(r: random.Random) -> str:
    A = [[r.randint(-4, 6) for _ in range(2)] for _ in range(2)]
    B = [[r.randint(-4, 6) for _ in range(2)] for _ in range(2)]
    C = [[sum(A[i][k] * B[k][j] for k in range(2)) for j in range(2)] for i in range(2)]
    det = A[0][0] * A[1][1] - A[0][1] * A[1][0]
    return (f"A = [[{A[0][0]}, {A[0][1]}], [{A[1][0]}, {A[1][1]}]], B = [[{B[0][0]}, {B[0][1]}], [{B[1][0]}, {B[1][1]}]].\n"
            f"AB = [[{C[0][0]}, {C[0][1]}], [{C[1][0]}, {C[1][1]}]] and det(A) = ({A[0][0]})*({A[1][1]}) - ({A[0][1]})*({A[1][0]}) = {det}.\n")


def series(r: random.Random) -> str:
    a, d, n = r.randint(1, 20), r.randint(1, 9), r.randint(5, 40)
    last = a + (n - 1) * d
    return (f"The arithmetic sequence {a}, {a + d}, {a + 2 * d}, ... has {n} terms ending at {last}. "
            f"Its sum is n(a_1 + a_n)/2 = {n}*({a} + {last})/2 = {n * (a + last) // 2}.\n")


def math_block(r: random.Random) -> str:
    makers = [linear_equation, word_problem, word_problem, fractions, derivative, gcd_steps, factorize, matrix, series]
    return "\n".join(r.choice(makers)(r) for _ in range(r.randint(3, 5)))


def table_block(r: random.Random) -> str:
    kind = r.randrange(5)
    if kind == 0:
        town = r.choice(TOWNS)
        rows = ["| Day | High (°C) | Low (°C) | Rain (mm) | Conditions |", "|---|---:|---:|---:|---|"]
        for d in DAYS:
            hi = r.randint(4, 31)
            rows.append(f"| {d} | {hi} | {hi - r.randint(3, 11)} | {r.choice([0, 0, 0.4, 1.2, 3.5, 7.8, 12.1])} | {r.choice(WEATHER)} |")
        return f"Seven-day forecast for {town}\n\n" + "\n".join(rows) + "\n"
    if kind == 1:
        rows = ["sku,item,quantity,unit_price,warehouse"]
        for _ in range(r.randint(6, 11)):
            item, price = r.choice(ITEMS)
            rows.append(f"{r.choice('ABCDEFGH')}{r.randint(1000, 9999)},{item},{r.randint(0, 480)},{price:.2f},{r.choice(TOWNS)}")
        return "inventory.csv\n" + "\n".join(rows) + "\n"
    if kind == 2:
        teams = r.sample(TEAMS, 6)
        stats = []
        for t in teams:
            w, dr, l = r.randint(2, 14), r.randint(0, 6), r.randint(1, 12)
            stats.append((3 * w + dr, t, w, dr, l))
        stats.sort(reverse=True)
        lines = [f"{'Pos':<4}{'Team':<24}{'W':>3}{'D':>3}{'L':>3}{'Pts':>5}"]
        lines += [f"{i + 1:<4}{t:<24}{w:>3}{dr:>3}{l:>3}{p:>5}" for i, (p, t, w, dr, l) in enumerate(stats)]
        return "League table after round " + str(r.randint(8, 30)) + "\n" + "\n".join(lines) + "\n"
    if kind == 3:
        name = person(r)
        tasks = r.sample(["Renew passport", "Call the plumber about the kitchen sink", "Book dentist appointment",
                          "Send quarterly report to finance", "Buy birthday present for Mum", "Back up laptop",
                          "Return library books", "Pay electricity bill", "Plan weekend hike route",
                          "Reply to landlord about lease", "Fix squeaky door hinge", "Order printer ink"], 6)
        marks = ["[x]" if r.random() < 0.4 else "[ ]" for _ in tasks]
        return f"To-do list for {name}\n" + "\n".join(f"- {m} {t}" for m, t in zip(marks, tasks)) + "\n"
    company = r.choice(COMPANIES)
    rev = [round(r.uniform(8, 60), 1) for _ in range(4)]
    lines = [f"{company}: quarterly results (millions of dollars)", "", "Quarter\tRevenue\tCosts\tMargin"]
    for q, v in enumerate(rev, 1):
        c = round(v * r.uniform(0.6, 0.95), 1)
        lines.append(f"Q{q}\t{v}\t{c}\t{(v - c) / v * 100:.1f}%")
    return "\n".join(lines) + "\n"


def chat_block(r: random.Random) -> str:
    q, answers = r.choice(TOPICS_CHAT)
    picked = r.sample(answers, r.randint(2, 4))
    style = r.randrange(3)
    user = r.choice(FIRST)
    intro = r.choice(["Good question.", "Sure.", "Happy to help.", "Here is a short answer.", "A few points:"])
    body = " ".join(picked) if r.random() < 0.5 else "\n" + "\n".join(f"{i + 1}. {p}" for i, p in enumerate(picked))
    follow = r.choice(["Thanks, that helps!", "Great, I'll try that tonight.", "What if that doesn't work?",
                       "Could you give an example?", "Makes sense, thank you."])
    closing = r.choice(["You're welcome. Let me know how it goes.",
                        "If it still doesn't work, describe exactly what happens and we can narrow it down.",
                        "Of course: start with the first point and check the result before changing anything else.",
                        "Glad it helped."])
    if style == 0:
        return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                f"<|im_start|>assistant\n{intro} {body}<|im_end|>\n<|im_start|>user\n{follow}<|im_end|>\n"
                f"<|im_start|>assistant\n{closing}<|im_end|>\n")
    if style == 1:
        return f"User: {q}\nAssistant: {intro} {body}\nUser: {follow}\nAssistant: {closing}\n"
    return f"{user}: {q}\nHelper: {intro}\n{body}\n{user}: {follow}\nHelper: {closing}\n"


def report_block(r: random.Random) -> str:
    kind = r.randrange(4)
    town = r.choice(TOWNS)
    if kind == 0:
        a, b = r.sample(TEAMS, 2)
        ga, gb = r.randint(0, 5), r.randint(0, 5)
        scorer = person(r)
        minute = r.randint(3, 90)
        verdict = "a draw" if ga == gb else (f"a win for the {a}" if ga > gb else f"a win for the {b}")
        return (f"The {a} met the {b} on {r.choice(DAYS)} evening in front of {r.randint(900, 24000):,} supporters. "
                f"{scorer} opened the scoring in the {minute}th minute with a low shot from the edge of the area. "
                f"The final score was {ga}-{gb}, {verdict}. "
                f"{r.choice(['The coach praised the defence after the match.', 'Rain made the second half scrappy.', 'Both sides finished with ten players.', 'The visitors dominated possession but created little.'])}\n")
    if kind == 1:
        hi = r.randint(-2, 34)
        return (f"Weather for {town}, {r.choice(DAYS)} {r.randint(1, 28)} {r.choice(MONTHS)}: expect {r.choice(WEATHER)} "
                f"in the morning and {r.choice(WEATHER)} later on. Highs near {hi}°C, lows around {hi - r.randint(4, 12)}°C. "
                f"Winds from the {r.choice(['north', 'south-west', 'east', 'north-east', 'west'])} at {r.randint(5, 55)} km/h.\n")
    if kind == 2:
        c = r.choice(COMPANIES)
        chg = r.uniform(-12, 15)
        return (f"{c} reported revenue of ${r.uniform(10, 900):.1f} million for the quarter, "
                f"{'up' if chg >= 0 else 'down'} {abs(chg):.1f}% from a year earlier. Chief executive {person(r)} said "
                f"demand in {town} had been {r.choice(['stronger than expected', 'uneven', 'steady', 'weaker in the spring'])}, "
                f"and the company plans to {r.choice(['open a second plant', 'hire 200 engineers', 'cut prices on older models', 'pay down debt'])} next year.\n")
    name = person(r)
    temp, ph = round(r.uniform(18, 37), 1), round(r.uniform(5.5, 8.2), 2)
    return (f"Lab notebook, {r.choice(MONTHS)} {r.randint(1, 28)}. Observer: {name}. Sample {r.randint(1, 60)} incubated at {temp} °C, "
            f"pH {ph}. Growth visible after {r.randint(6, 72)} h; optical density {r.uniform(0.05, 1.9):.3f} at 600 nm. "
            f"Next: repeat with {r.choice(['fresh medium', 'half the inoculum', 'a second strain', 'no antibiotic'])}.\n")


def logs_block(r: random.Random) -> str:
    kind = r.randrange(3)
    if kind == 0:
        lines = []
        t = r.randint(0, 80000)
        svc = r.choice(SERVICES)
        day = f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        for _ in range(r.randint(5, 9)):
            t += r.randint(1, 900)
            lvl = r.choice(LEVELS)
            msg = {
                "INFO": f"request completed path=/api/v{r.randint(1, 3)}/{r.choice(['orders', 'users', 'items', 'reports'])} status=200 ms={r.randint(3, 480)}",
                "DEBUG": f"cache lookup key=user:{r.randint(1000, 99999)} hit={r.choice(['true', 'false'])}",
                "WARN": f"slow query took {r.randint(500, 4000)} ms on table {r.choice(['orders', 'events', 'sessions'])}",
                "ERROR": f"upstream timeout after {r.randint(5, 30)}s host={r.choice(SERVICES)}:{r.choice([80, 443, 8080, 9000])} retry={r.randint(1, 3)}",
            }[lvl]
            lines.append(f"{day}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z {lvl:<5} {svc} {msg}")
        return "\n".join(lines) + "\n"
    if kind == 1:
        rec = {"id": r.randint(10000, 99999), "name": person(r), "city": r.choice(TOWNS),
               "active": r.random() < 0.7, "tags": r.sample(["beta", "admin", "trial", "vip", "mobile", "eu"], 2),
               "balance": round(r.uniform(-50, 5000), 2), "last_login": f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"}
        return json.dumps(rec, indent=2, ensure_ascii=False) + "\n"
    svc = r.choice(SERVICES)
    return (f"# {svc} deployment\nservice:\n  name: {svc}\n  replicas: {r.randint(1, 8)}\n  image: registry.local/{svc}:{r.randint(1, 4)}.{r.randint(0, 20)}.{r.randint(0, 9)}\n"
            f"  resources:\n    cpu: \"{r.choice(['250m', '500m', '1', '2'])}\"\n    memory: {r.choice(['256Mi', '512Mi', '1Gi', '4Gi'])}\n"
            f"  env:\n    LOG_LEVEL: {r.choice(['info', 'debug', 'warn'])}\n    TIMEOUT_SECONDS: {r.randint(5, 120)}\n")


def foreign_block(r: random.Random) -> str:
    fill = dict(town=r.choice(TOWNS), h=r.randint(6, 20), mm=f"{r.choice([0, 15, 30, 45]):02d}", name=r.choice(FIRST),
                n=r.randint(2, 30), m=r.randint(4, 45), g=r.randint(1, 19), t=r.randint(-8, 12),
                jour=r.choice(JOUR_FR), jour_de=r.choice(JOUR_DE), jour_es=r.choice(JOUR_ES),
                fruit_fr=r.choice(FRUIT_FR), fruit_es=r.choice(FRUIT_ES), weather_es=r.choice(WEATHER_ES))
    lang = r.choice([FR, DE, ES])
    return " ".join(s.format(**fill) for s in r.sample(lang, 3)) + "\n"


def compose(seed: int = SEED, blocks: int = 150) -> str:
    """Build the generated calibration text: a deterministic shuffle of genre blocks."""
    r = random.Random(seed)
    makers = [math_block] * 4 + [table_block] * 3 + [chat_block] * 3 + [report_block] * 3 + [logs_block] * 2 + [foreign_block]
    return "\n".join(r.choice(makers)(r) for _ in range(blocks))


if __name__ == "__main__":
    text = compose()
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.encode('utf-8')):,} bytes)")
