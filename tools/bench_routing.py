#!/usr/bin/env python
"""Routing benchmark: one question with 40 described options, 50 distinct tickets of about
100 tokens, answered through the engine in the state-first and the options-first layout, in one run.

Each layout answers every ticket once after one warm-up ticket (so the template head is cached in both
layouts); the layouts run one after the other, not interleaved: the engine holds one prefix, and
alternating layouts would evict each other's prefix. Within a layout the adapter and llama-server
alternate per ticket, so their ratio is measured under the same machine conditions. Prints the p50 per layout and the ratio
options-first / state-first (goal: at most 0.25), and the tokens evaluated per ticket.

With --llama-server BINARY, upstream llama-server (tools/bench_llama_server.py's LlamaServer, same model,
threads, context and batch sizes) answers the same prompt texts through POST /completion with
n_predict 1 and cache_prompt on, in both layouts: its prompt cache reuses the longest common prefix too.

usage: python tools/bench_routing.py [--model GGUF] [--tickets 50] [--threads N] [--llama-server BIN]
                                     [--ticket-start numbered|unique] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from semif.serving.config import embedded_model_path  # noqa: E402
from semif.serving.engine.context import Engine  # noqa: E402
from semif.serving.engine.prompt import Outcome, Question  # noqa: E402

TEAMS = [
    ("network", "Wi-Fi, VPN, proxy and internet connectivity problems."),
    ("hardware", "Broken or missing laptops, monitors, keyboards and docking stations."),
    ("printing", "Printers, scanners, toner and print queues."),
    ("email", "Mailboxes, distribution lists, spam and calendar sharing."),
    ("identity", "Passwords, multi-factor authentication, account lockouts."),
    ("licences", "Requests for new software or licences and renewals."),
    ("payroll", "Salary, payslips, tax forms and bonus payments."),
    ("benefits", "Health insurance, pensions and other employee benefits."),
    ("travel", "Business travel bookings, visas and travel policy questions."),
    ("expenses", "Expense claims, receipts, corporate card statements."),
    ("facilities", "Building access, desks, heating, lighting and cleaning."),
    ("security", "Phishing reports, malware, lost devices and data leaks."),
    ("procurement", "Purchase orders, vendor onboarding and quotes."),
    ("legal", "Contracts, NDAs, compliance questions and disputes."),
    ("recruiting", "Job postings, interviews, candidate referrals."),
    ("onboarding", "New starters: accounts, equipment and first-week setup."),
    ("offboarding", "Leavers: account removal, equipment return, exit forms."),
    ("database", "Database access, slow queries, backups and restores."),
    ("cloud", "Cloud accounts, quotas, cost alerts and permissions."),
    ("ci_cd", "Build pipelines, deployments and release automation."),
    ("source_control", "Repository access, branch protection and merge problems."),
    ("monitoring", "Dashboards, alerts, on-call paging and log search."),
    ("mobile", "Company phones, mobile apps and device management."),
    ("telephony", "Desk phones, conference bridges and voicemail."),
    ("video", "Video conferencing rooms, cameras and screen sharing."),
    ("crm", "Customer relationship management system issues."),
    ("erp", "Finance and resource planning system errors."),
    ("data_requests", "Reports, data exports and analytics access."),
    ("privacy", "Personal data requests, consent and retention questions."),
    ("training", "Courses, certifications and learning platform access."),
    ("translation", "Document translation and localisation requests."),
    ("marketing", "Brand assets, campaigns, website content changes."),
    ("sales_ops", "Quotes, territories, commission and sales tooling."),
    ("customer_refunds", "Refunds and chargebacks for customer orders."),
    ("billing", "Customer invoices, payment failures and billing addresses."),
    ("shipping", "Customer deliveries, tracking numbers and lost parcels."),
    ("returns", "Customer product returns and replacements."),
    ("accessibility", "Assistive technology and accessibility accommodations."),
    ("health_safety", "Workplace accidents, hazards and first aid."),
    ("other", "Anything that fits none of the teams above."),
]
SUBJECTS = ["my laptop", "the VPN client", "the office printer", "my payslip", "the expense tool", "the CRM",
            "the build pipeline", "my phone", "the meeting room camera", "the customer's parcel", "my password",
            "the database backup", "the cloud bill", "the new starter's account", "the invoice run"]
PROBLEMS = ["stopped working this morning", "shows an error I have never seen", "is much slower than usual",
            "was charged twice", "cannot be reached from home", "keeps asking me to sign in again",
            "lost all the settings after the update", "needs to be set up before Monday"]
DETAILS = ["I already restarted everything twice and cleared the cache.", "Three colleagues on my floor see the same thing.",
           "The error code mentions a timeout after thirty seconds.", "It worked fine last Friday before the maintenance window.",
           "I need it for a customer presentation tomorrow at nine.", "Our team lead asked me to open a ticket for it.",
           "The reference number from the last ticket was closed without a fix.", "I attached a screenshot of the message."]


def tickets(n: int, seed: int = 7) -> list[str]:
    """``n`` distinct tickets of about 100 tokens (deterministic)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = [f"Ticket {1000 + i}: Hello, {rng.choice(SUBJECTS)} {rng.choice(PROBLEMS)}."]
        parts += rng.sample(DETAILS, 5)
        parts.append(f"Also, {rng.choice(SUBJECTS)} {rng.choice(PROBLEMS)}. Thanks, employee {rng.randint(100, 999)}.")
        out.append(" ".join(parts))
    return out


QUESTION = Question("Which team should take this ticket?", tuple(Outcome(k, d) for k, d in TEAMS))


WARM_UP = "Warm-up ticket: the Wi-Fi is down."


def bench_layout(engine: Engine, server, texts: list[str], layout: str) -> dict:
    """Every ticket through the engine and, when given, llama-server, alternating which goes first per
    ticket (each keeps its own cache: the engine its context, the server its slot), so the two are
    compared under the same machine conditions. llama-server reports the prompt tokens it evaluated
    (``timings.prompt_n``): its cache reuses the longest common token prefix with the previous prompt."""

    def prompt(text: str) -> str:
        plan = engine.plan(text, [QUESTION], layout=layout)
        return plan.prefix_text + plan.questions[0].text

    body = lambda text: {"prompt": prompt(text), "n_predict": 1, "temperature": 0, "cache_prompt": True}  # noqa: E731
    engine.invalidate()
    engine.score(WARM_UP, [QUESTION], layout=layout)
    if server is not None:
        server.post_ms("/completion", body(WARM_UP))
    times, evaluated, tokens, server_times, server_evaluated = [], [], [], [], []
    for index, text in enumerate(texts):
        def adapter_run():
            started = time.perf_counter()
            result = engine.score(text, [QUESTION], layout=layout)
            times.append((time.perf_counter() - started) * 1000)
            evaluated.append(result.evaluated_tokens)
            tokens.append(result.input_tokens)

        def server_run():
            ms, answer = server.post_ms("/completion", body(text))
            server_times.append(ms)
            server_evaluated.append(answer.get("timings", {}).get("prompt_n", float("nan")))

        runs = [adapter_run] + ([server_run] if server is not None else [])
        for run in (runs if index % 2 == 0 else runs[::-1]):
            run()
    out = {"adapter": {"p50_ms": statistics.median(times), "mean_evaluated": statistics.mean(evaluated),
                       "mean_tokens": statistics.mean(tokens), "template_version": engine.template.version(layout)}}
    if server is not None:
        out["llama-server"] = {"p50_ms": statistics.median(server_times), "mean_evaluated": statistics.mean(server_evaluated)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tickets", type=int, default=50)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", type=Path, default=None, help="also time upstream llama-server (binary path)")
    parser.add_argument("--layouts", default="state_first,options_first", help="comma-separated, of state_first, options_first")
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on",
                        help="the adapter's flash attention (SEMIF_FLASH_ATTN; default on, as the server's)")
    parser.add_argument("--server-flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="llama-server's -fa (its default, auto, is on for the CPU)")
    parser.add_argument("--ticket-start", choices=("numbered", "unique"), default="numbered",
                        help="numbered (default): tickets start 'Ticket 1000: Hello, ...', so consecutive tickets share "
                             "their first tokens, which llama-server's token-level prompt cache reuses and the adapter's "
                             "segment reuse does not; unique (with --llama-server): every ticket starts with its own "
                             "single-token word, so neither side can reuse any ticket token")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    layouts = [l.strip() for l in args.layouts.split(",") if l.strip()]
    texts = tickets(args.tickets)
    if args.ticket_start == "unique" and not args.llama_server:
        raise SystemExit("--ticket-start unique needs --llama-server (its vocabulary finds the words)")
    model = args.model or embedded_model_path()
    engine = Engine(model, n_ctx=4096, n_batch=512, n_threads=args.threads, label_memo=False, flash_attn=args.flash_attn == "on")
    n_tokens = statistics.mean(len(engine._tokenize(t, special=False)) for t in texts)
    n_options = len(engine._tokenize(engine.plan("x", [QUESTION], layout="options_first").prefix_pieces[1].text, special=False))
    print(f"model {engine.info['file']}, {len(TEAMS)} options ({n_options} tokens of question and options), "
          f"{len(texts)} tickets of {n_tokens:.0f} tokens on average, {args.threads} threads, adapter flash attention "
          f"{args.flash_attn}, llama-server -fa {args.server_flash_attn}", flush=True)
    results = {}
    server = None
    if args.llama_server:
        from bench_llama_server import LlamaServer

        server = LlamaServer(args.llama_server, model, args.threads, Path("/tmp/bench_routing_llama_server.log"),
                             ("-fa", args.server_flash_attn))
        if args.ticket_start == "unique":
            from bench_llama_server import unique_state_words

            probe = engine.plan("Probe.", [QUESTION], return_prompt=True).prefix_text
            opener = probe[probe.rfind("<state") : probe.rfind("Probe.")]
            words = unique_state_words(server, opener, len(texts), follow=" Ticket 1000: Hello")
            texts = [f"{word} {text}" for word, text in zip(words, texts)]
    try:
        for layout in layouts:
            measured = bench_layout(engine, server, texts, layout)
            results[f"adapter/{layout}"] = r = measured["adapter"]
            print(f"adapter {layout:13s}: p50 {r['p50_ms']:8.1f} ms, {r['mean_evaluated']:.0f} of {r['mean_tokens']:.0f} "
                  f"tokens evaluated per ticket ({r['template_version']})", flush=True)
            if server is not None:
                results[f"llama-server/{layout}"] = s = measured["llama-server"]
                print(f"llama-server {layout:13s}: p50 {s['p50_ms']:8.1f} ms, {s['mean_evaluated']:.0f} prompt tokens "
                      f"evaluated per ticket; adapter / llama-server p50 {r['p50_ms'] / s['p50_ms']:.3f}", flush=True)
    finally:
        if server is not None:
            server.close()
    ratio = None
    if len(layouts) == 2:
        ratio = results["adapter/options_first"]["p50_ms"] / results["adapter/state_first"]["p50_ms"]
        print(f"options-first / state-first p50: {ratio:.3f} (goal <= 0.25)")
    if server is not None:
        best_adapter = min(results[f"adapter/{l}"]["p50_ms"] for l in layouts)
        best_server = min(results[f"llama-server/{l}"]["p50_ms"] for l in layouts)
        print(f"adapter best / llama-server best p50: {best_adapter / best_server:.3f} (goal <= 0.95)")
    if args.json:
        args.json.write_text(json.dumps({"model": engine.info["file"], "results": results, "ratio": ratio,
                                         "ticket_start": args.ticket_start,
                                         "adapter_flash_attn": args.flash_attn, "server_flash_attn": args.server_flash_attn}, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
