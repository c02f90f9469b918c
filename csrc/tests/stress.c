/*
 * stress.c -- a multi-threaded stress driver for the core, meant to be run
 * under ThreadSanitizer (zero reports expected), under ASan+UBSan, and as a
 * plain -O2 build.  Each scenario is a function; its worker threads start
 * behind a pthread barrier.  Every timer has a record (struct trec) of what
 * happened to it -- cancel results, callback runs, drops -- kept in atomics,
 * and after the threads are joined (and bt_stop has joined the timer thread)
 * every record is checked:
 *
 *   - it ran exactly once, or exactly one cancel won, or (scenario 4) it was
 *     dropped by bt_drop_all: never two of these, never none;
 *   - a repeated cancel by the same thread never returns BT_CANCELLED;
 *   - it never ran before its deadline, its callback saw its own id, and a
 *     cancel from inside its own callback answered BT_TOO_LATE;
 *   - the core's counters agree with what the records saw.
 *
 * The test synchronises only through atomics, joins, the barrier and the
 * core's own happens-before (a record's plain fields are written before the
 * timer is scheduled and read by whoever runs it), so a TSan report is a
 * report about the core.
 *
 * Scenarios (4 worker threads each):
 *   native_rpc      native timers with clustered deadlines, half cancelled:
 *                   at once, twice, after a short spin, or around the deadline
 *   from_callbacks  callbacks that schedule (chains of depth 3) and callbacks
 *                   that cancel another timer, racing the workers' cancels
 *   ports           port timers run by a poll()ing consumer thread, which
 *                   runs passes of its own (bt_port_deliver_due); cancels
 *                   landing after the post must win over a later claim
 *   stop_race       bt_stop while workers schedule and cancel (native, port,
 *                   chains), then bt_drop_all: ran, cancelled or dropped
 *   garbage_churn   far timers, nearly all cancelled, some by another thread:
 *                   bucket drains, prunes and a heap sweep
 * Every scenario ends with bt_stop, bt_drop_all (nothing to drop unless the
 * scenario stopped early), draining the ports, and early_fires == 0.
 *
 *   drop_vs_consumer    bt_drop_all against a running port consumer
 *   stop_inflight_drop  bt_drop_all against a schedule in flight at bt_stop
 *   detach_vs_post      bt_port_detach and a drain while the timer thread
 *                       posts a batch to the port
 * These last three reproduced real races of an earlier core (bt_drop_all read
 * a slot's fields after its CAS handed the slot to the consumer; a schedule
 * past its stop check could publish after bt_drop_all; a post decided on
 * "not detached" before a detach and pushed after the drain that followed
 * it).  All are fixed and the scenarios run by default as regression tests.
 *
 *   usage: stress [scale] [scenario]
 *
 * scale (default 1) multiplies every iteration count; a scenario name runs
 * only that scenario.
 *
 * Prints one line per scenario and then "N passed, N failed".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bucketimer.h"

#include "check.h"

#define US 1000LL
#define MS 1000000LL
#define NTHREADS 4
#define QUIESCE_TIMEOUT (5000 * MS)

static double scale = 1.0;

static size_t scaled(double n) {
    double v = n * scale;
    return v < 1 ? 1 : (size_t)v;
}

typedef unsigned long long ull;

/* ---- per-timer records ----------------------------------------------------- */

enum kind { K_PLAIN, K_CHAIN, K_CANCELLER, K_TARGET };
#define NONE (-1)

struct trec {
    /* Plain fields: written by the scheduling thread before bt_schedule_*,
     * read by whoever runs the timer (through the core's happens-before), and
     * by the main thread after joins. */
    int64_t deadline;
    struct trec *next; /* K_CHAIN: the child to schedule; K_CANCELLER: its target */
    int kind;
    int depth;
    int strict;   /* K_TARGET: fires after its canceller, so that cancel must win */
    int is_port;
    int multi;    /* someone besides the owner may cancel it */
    /* Atomics: written by any thread. */
    _Atomic uint64_t id; /* published (release) once bt_schedule_* returned */
    _Atomic int scheduled;
    _Atomic int runs;
    _Atomic int wins;        /* cancels that returned BT_CANCELLED */
    _Atomic int dropped;     /* bt_drop_all reported it */
    _Atomic int first;       /* result of the owner's first cancel, NONE if none */
    _Atomic int later_won;   /* a repeated owner cancel returned BT_CANCELLED */
    _Atomic int owner_tries;
    _Atomic int cb_cancel;   /* result of a cancel issued from a callback */
    _Atomic int early;
    _Atomic int bad_id;
    _Atomic int bad_self_cancel;
    _Atomic int bad_drop;
    _Atomic int64_t cancel_done_at; /* after the owner's first cancel returned */
    _Atomic int64_t claim_at;       /* ports: right before bt_timer_claim */
    _Atomic int64_t ran_at;
};

static struct trec *alloc_recs(size_t n) {
    struct trec *r = calloc(n, sizeof(*r));
    if (!r) {
        perror("calloc");
        exit(2);
    }
    for (size_t i = 0; i < n; i++) {
        atomic_init(&r[i].first, NONE);
        atomic_init(&r[i].cb_cancel, NONE);
    }
    return r;
}

/* ---- scenario-wide state ----------------------------------------------------- */

static struct {
    bt_timer_thread *tt;
    bt_port *port;
    pthread_barrier_t barrier;
    _Atomic uint64_t scheduled;    /* successful schedules (workers + callbacks) */
    _Atomic uint64_t cb_scheduled; /* of those, from callbacks */
    _Atomic uint64_t completed;    /* callbacks / claimed port timers finished */
    _Atomic uint64_t wins;         /* cancels that won */
    _Atomic uint64_t errors;       /* unexpected return codes */
    _Atomic uint64_t claim_failed; /* popped from a port, claim refused */
    _Atomic uint64_t popped;
    _Atomic uint64_t cancel_skipped;   /* callback found its target's id unpublished */
    _Atomic uint64_t shutdown_seen;    /* schedules that returned -ESHUTDOWN */
    _Atomic uint64_t sched_after_stop; /* schedules returning 0 after bt_stop returned */
    _Atomic uint64_t shutdown_seen_cb; /* the same, from callbacks */
    _Atomic uint64_t drops;
    _Atomic uint64_t null_drops;
    _Atomic int stop_consumer;
    _Atomic int stop_returned;
    _Atomic int stopping; /* bt_stop may run: -ESHUTDOWN is expected */
    _Atomic int slow_consumer;
} G;

static void reset_state(unsigned nthreads) {
    memset(&G, 0, sizeof(G));
    pthread_barrier_init(&G.barrier, NULL, nthreads);
}

static void count_error(const char *what, int rc) {
    if (atomic_fetch_add(&G.errors, 1) < 5) fprintf(stderr, "  unexpected: %s -> %d\n", what, rc);
}

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static void spin_until(int64_t t) {
    while (bt_now_ns() < t) {
    }
}

/* Waits until t: sleeps while far, spins the last stretch. */
static void wait_until(int64_t t) {
    int64_t left;
    while ((left = t - bt_now_ns()) > 150 * US) usleep((useconds_t)((left - 100 * US) / US));
    spin_until(t);
}

/* Workers schedule in bursts of BURST and then sleep twice as long as the
 * burst took: four busy threads on a two-core machine (slower still under
 * TSan) would otherwise starve the timer thread, every timer would fire long
 * after its cancel, and no cancel would race a fire. */
#define BURST 32
static void pace(size_t i, int64_t *mark) {
    if (i % BURST != BURST - 1) return;
    int64_t now = bt_now_ns();
    int64_t busy = *mark ? now - *mark : 0;
    if (busy > 5 * MS) busy = 5 * MS;
    usleep((useconds_t)(50 + 2 * busy / US));
    *mark = bt_now_ns();
}

static void publish(struct trec *r, uint64_t id) {
    atomic_store_explicit(&r->scheduled, 1, memory_order_relaxed);
    atomic_store_explicit(&r->id, id, memory_order_release);
    atomic_fetch_add(&G.scheduled, 1);
}

static int note_cancel(struct trec *r, int rc) {
    if (rc == BT_CANCELLED) {
        atomic_fetch_add(&r->wins, 1);
        atomic_fetch_add(&G.wins, 1);
    } else if (rc != BT_TOO_LATE && rc != BT_UNKNOWN) {
        count_error("bt_cancel", rc);
    }
    return rc;
}

/* The thread that scheduled r cancels it.  The first such cancel's result is
 * the one the "ran XOR cancelled" invariant is about; a repeated one must
 * never win. */
static void owner_cancel(struct trec *r) {
    uint64_t id = atomic_load_explicit(&r->id, memory_order_acquire);
    int rc = note_cancel(r, bt_cancel(G.tt, id));
    int64_t done = bt_now_ns();
    if (atomic_fetch_add(&r->owner_tries, 1) == 0) {
        atomic_store(&r->first, rc);
        atomic_store(&r->cancel_done_at, done);
    } else if (rc == BT_CANCELLED) {
        atomic_fetch_add(&r->later_won, 1);
    }
}

/* Cancels scheduled for later by a worker: FIFO, processed when due. */
struct deferred {
    struct trec *r;
    int64_t at;
    int twice;
};
struct dqueue {
    struct deferred *v;
    size_t head, tail;
};

static void dq_init(struct dqueue *q, size_t n) {
    q->v = malloc((n ? n : 1) * sizeof(*q->v));
    if (!q->v) {
        perror("malloc");
        exit(2);
    }
    q->head = q->tail = 0;
}

static void dq_push(struct dqueue *q, struct trec *r, int64_t at, int twice) {
    q->v[q->tail++] = (struct deferred){r, at, twice};
}

/* Runs the due cancels at the head; with wait, runs all of them, spinning
 * until each is due. */
static void dq_run(struct dqueue *q, int wait) {
    while (q->head < q->tail) {
        struct deferred *d = &q->v[q->head];
        if (bt_now_ns() < d->at) {
            if (!wait) return;
            wait_until(d->at);
        }
        owner_cancel(d->r);
        if (d->twice) owner_cancel(d->r);
        q->head++;
    }
}

/* ---- callbacks ------------------------------------------------------------------ */

static void on_fire(void *arg, uint64_t id) {
    struct trec *r = arg;
    int64_t now = bt_now_ns();
    if (now < r->deadline) atomic_fetch_add(&r->early, 1);
    atomic_store(&r->ran_at, now);
    uint64_t pub = atomic_load_explicit(&r->id, memory_order_acquire);
    if (pub && pub != id) atomic_fetch_add(&r->bad_id, 1);
    /* It is running: cancelling itself is too late. */
    if (bt_cancel(G.tt, id) != BT_TOO_LATE) atomic_fetch_add(&r->bad_self_cancel, 1);
    if (r->kind == K_CHAIN && r->next) {
        struct trec *c = r->next;
        c->deadline = now + (int64_t)(mix(id) % 200) * US;
        uint64_t cid;
        int rc = bt_schedule_native(G.tt, c->deadline, on_fire, c, &cid);
        if (rc == 0) {
            publish(c, cid);
            atomic_fetch_add(&G.cb_scheduled, 1);
        } else if (rc == -ESHUTDOWN && atomic_load(&G.stopping)) {
            atomic_fetch_add(&G.shutdown_seen_cb, 1);
        } else {
            count_error("bt_schedule_native from a callback", rc);
        }
    } else if (r->kind == K_CANCELLER) {
        struct trec *b = r->next;
        uint64_t bid = atomic_load_explicit(&b->id, memory_order_acquire);
        if (bid) atomic_store(&b->cb_cancel, note_cancel(b, bt_cancel(G.tt, bid)));
        else atomic_fetch_add(&G.cancel_skipped, 1);
    }
    /* Counted last: "completed" never gets ahead of a child's schedule. */
    atomic_fetch_add(&r->runs, 1);
    atomic_fetch_add(&G.completed, 1);
}

static void on_drop(void *ctx, bt_port *port, void *payload) {
    (void)ctx;
    struct trec *r = payload;
    atomic_fetch_add(&G.drops, 1);
    if (!r) {
        atomic_fetch_add(&G.null_drops, 1);
        return;
    }
    if (r->is_port ? port != G.port : port != NULL) atomic_fetch_add(&r->bad_drop, 1);
    atomic_fetch_add(&r->dropped, 1);
}

/* ---- the port consumer ------------------------------------------------------------ */

static int consume_one(bt_port *port, bt_timer *t, unsigned *seed) {
    struct trec *r = bt_timer_payload(t);
    uint64_t id = bt_timer_id(t);
    int64_t dl = bt_timer_deadline(t);
    int claimed = 0;
    if (!r) {
        count_error("bt_timer_payload == NULL", 0);
        bt_timer_release(port, t);
        atomic_fetch_add(&G.popped, 1);
        return 0;
    }
    uint64_t pub = atomic_load_explicit(&r->id, memory_order_acquire);
    if ((pub && pub != id) || dl != r->deadline) atomic_fetch_add(&r->bad_id, 1);
    /* A slow consumer leaves posted timers unclaimed longer, so that late
     * cancels land on POSTED. */
    if (seed && atomic_load_explicit(&G.slow_consumer, memory_order_relaxed) &&
        rand_r(seed) % 32 == 0)
        spin_until(bt_now_ns() + 30 * US);
    atomic_store(&r->claim_at, bt_now_ns());
    if (bt_timer_claim(port, t)) {
        int64_t now = bt_now_ns();
        if (now < dl) atomic_fetch_add(&r->early, 1);
        atomic_store(&r->ran_at, now);
        atomic_fetch_add(&r->runs, 1);
        atomic_fetch_add(&G.completed, 1);
        claimed = 1;
    } else {
        atomic_fetch_add(&G.claim_failed, 1);
    }
    bt_timer_release(port, t);
    atomic_fetch_add(&G.popped, 1);
    return claimed;
}

static void *consumer_main(void *arg) {
    (void)arg;
    unsigned seed = 777;
    int fd = bt_port_fd(G.port);
    while (!atomic_load(&G.stop_consumer)) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int n = poll(&pfd, 1, 100);
        if (n < 0 && errno != EINTR) {
            count_error("poll", errno);
            break;
        }
        bt_port_ack(G.port);
        if (atomic_load_explicit(&G.slow_consumer, memory_order_relaxed) && rand_r(&seed) % 8 == 0)
            usleep(100 + rand_r(&seed) % 300);
        /* As a loop does after its poll: the pass run here, racing the
         * timer thread's, the workers' schedules and cancels, and a stop. */
        int rc = bt_port_deliver_due(G.port, bt_now_ns(), (int32_t)(rand_r(&seed) & 1));
        if (rc < 0 && rc != -EBUSY && rc != -ESHUTDOWN) count_error("bt_port_deliver_due", -rc);
        bt_timer *t;
        while ((t = bt_port_pop(G.port)) != NULL) consume_one(G.port, t, &seed);
    }
    return NULL;
}

/* Pops whatever the port still holds, on the calling thread.  Returns how
 * many of those were claimed. */
static size_t drain_port(bt_port *port, size_t *popped) {
    size_t claimed = 0, n = 0;
    bt_port_ack(port);
    bt_timer *t;
    while ((t = bt_port_pop(port)) != NULL) {
        claimed += (size_t)consume_one(port, t, NULL);
        n++;
    }
    if (popped) *popped = n;
    return claimed;
}

/* ---- waiting for the core to settle ------------------------------------------------ */

/* Every scheduled timer either completed or lost to a cancel.  Call only once
 * no thread but the timer thread (and its callbacks) schedules any more: then
 * "scheduled" is never behind "completed + wins", so reading the latter first
 * makes equality mean the whole system is idle. */
static int wait_accounted(void) {
    int64_t end = bt_now_ns() + QUIESCE_TIMEOUT;
    for (;;) {
        uint64_t c = atomic_load(&G.completed) + atomic_load(&G.wins);
        uint64_t s = atomic_load(&G.scheduled);
        if (c == s) return 1;
        if (bt_now_ns() > end) {
            fprintf(stderr, "  not accounted after timeout: scheduled %llu, completed %llu, wins %llu\n",
                    (ull)s, (ull)atomic_load(&G.completed), (ull)atomic_load(&G.wins));
            return 0;
        }
        usleep(1000);
    }
}

/* Lateness: the histogram bucket holding the median and the highest used. */
static void lateness(const bt_stats *s, double *p50_us, double *max_us) {
    uint64_t total = 0, acc = 0;
    int hi = 0, med = -1;
    for (int i = 0; i < BT_HIST_BUCKETS; i++) {
        total += s->lateness_hist[i];
        if (s->lateness_hist[i]) hi = i;
    }
    for (int i = 0; i < BT_HIST_BUCKETS && med < 0; i++) {
        acc += s->lateness_hist[i];
        if (total && 2 * acc >= total) med = i;
    }
    *p50_us = med <= 0 ? 0 : (double)(1ULL << med) / 1e3;
    *max_us = hi == 0 ? 0 : (double)(1ULL << hi) / 1e3;
}

static void print_stats(const char *what, const bt_stats *s) {
    fprintf(stderr,
            "  %s: scheduled %llu cancelled %llu fired %llu posted %llu ran %llu reaped %llu "
            "heap %llu list %llu dead %llu slots %llu free %llu early %llu\n",
            what, (ull)s->scheduled, (ull)s->cancelled, (ull)s->fired, (ull)s->posted,
            (ull)s->ran, (ull)s->reaped, (ull)s->heap_size, (ull)s->list_size, (ull)s->dead,
            (ull)s->slots, (ull)s->slots_free, (ull)s->early_fires);
}

/* The core reaped every cancelled entry and the port consumer popped every
 * posted timer: fired + reaped counts each scheduled timer once, except the
 * ones cancelled while posted, which are both fired and (by the consumer)
 * reaped. */
static int wait_core_settled(void) {
    int64_t end = bt_now_ns() + QUIESCE_TIMEOUT;
    bt_stats s;
    for (;;) {
        bt_get_stats(G.tt, &s);
        uint64_t cf = atomic_load(&G.claim_failed);
        uint64_t popped = atomic_load(&G.popped);
        if (s.fired + s.reaped == s.scheduled + cf && s.posted == popped) return 1;
        if (bt_now_ns() > end) {
            print_stats("core not settled after timeout", &s);
            fprintf(stderr, "  claim_failed %llu popped %llu\n", (ull)cf, (ull)popped);
            return 0;
        }
        usleep(1000);
    }
}

/* ---- checking the records ------------------------------------------------------ */

struct tally {
    size_t scheduled, ran, won, dropped, first_won, first_late, first_unknown;
    size_t cb_won, cb_late, violations;
};

static void violation(struct tally *t, const struct trec *r, const char *what) {
    if (t->violations++ < 8)
        fprintf(stderr,
                "  violation (%s): kind %d depth %d port %d id %#llx deadline %lld scheduled %d "
                "runs %d wins %d dropped %d first %d later_won %d cb_cancel %d early %d "
                "ran_at %lld cancel_done_at %lld claim_at %lld\n",
                what, r->kind, r->depth, r->is_port, (ull)atomic_load(&r->id), (long long)r->deadline,
                atomic_load(&r->scheduled), atomic_load(&r->runs), atomic_load(&r->wins),
                atomic_load(&r->dropped), atomic_load(&r->first), atomic_load(&r->later_won),
                atomic_load(&r->cb_cancel), atomic_load(&r->early),
                (long long)atomic_load(&r->ran_at), (long long)atomic_load(&r->cancel_done_at),
                (long long)atomic_load(&r->claim_at));
}

static void check_records(const struct trec *recs, size_t n, struct tally *t) {
    for (size_t i = 0; i < n; i++) {
        const struct trec *r = &recs[i];
        int runs = atomic_load(&r->runs), wins = atomic_load(&r->wins);
        int dropped = atomic_load(&r->dropped), first = atomic_load(&r->first);
        int cb = atomic_load(&r->cb_cancel);
        if (!atomic_load(&r->scheduled)) {
            if (runs || wins || dropped) violation(t, r, "activity on an unscheduled timer");
            continue;
        }
        t->scheduled++;
        t->ran += (size_t)runs;
        t->won += (size_t)wins;
        t->dropped += (size_t)dropped;
        if (first == BT_CANCELLED) t->first_won++;
        if (first == BT_TOO_LATE) t->first_late++;
        if (first == BT_UNKNOWN) t->first_unknown++;
        if (cb == BT_CANCELLED) t->cb_won++;
        if (cb == BT_TOO_LATE || cb == BT_UNKNOWN) t->cb_late++;
        if (runs + wins + dropped != 1) violation(t, r, "not exactly one of ran/cancelled/dropped");
        if (atomic_load(&r->later_won)) violation(t, r, "a repeated cancel won");
        if (first == BT_CANCELLED && runs) violation(t, r, "ran after its cancel won");
        if (!r->multi && first != NONE && first != BT_CANCELLED && !runs && !dropped)
            violation(t, r, "cancel lost but it never ran");
        if (atomic_load(&r->early)) violation(t, r, "ran before its deadline");
        if (atomic_load(&r->bad_id)) violation(t, r, "id/deadline seen by the runner differs");
        if (atomic_load(&r->bad_self_cancel)) violation(t, r, "cancel from its own callback not TOO_LATE");
        if (atomic_load(&r->bad_drop)) violation(t, r, "dropped with the wrong port");
        if (r->kind == K_TARGET && r->strict && cb != NONE && cb != BT_CANCELLED && first != BT_CANCELLED)
            violation(t, r, "callback's cancel of a later timer did not win");
        /* Ports: a cancel that returned before the consumer even tried to
         * claim found the timer PENDING or POSTED, so it had to win. */
        if (r->is_port && first != NONE && first != BT_CANCELLED && runs &&
            atomic_load(&r->cancel_done_at) < atomic_load(&r->claim_at))
            violation(t, r, "cancel returned too-late before the claim");
    }
}

/* ---- core creation ------------------------------------------------------------- */

static bt_timer_thread *make_core(int with_port) {
    bt_timer_thread *tt = NULL;
    int rc = bt_create(NULL, &tt);
    if (rc || !tt) {
        fprintf(stderr, "bt_create: %d\n", rc);
        exit(2);
    }
    G.tt = tt;
    G.port = NULL;
    if (with_port) {
        rc = bt_port_open(tt, 1, &G.port);
        CHECK(rc == 0 && G.port && bt_port_fd(G.port) >= 0);
    }
    return tt;
}

struct worker {
    pthread_t th;
    int idx;
    unsigned seed;
    struct trec *recs;
    size_t n;
};

static void start_workers(struct worker *w, int n, void *(*fn)(void *), struct trec *recs,
                          size_t per) {
    for (int i = 0; i < n; i++) {
        w[i].idx = i;
        w[i].seed = 1000u + 7919u * (unsigned)i;
        w[i].recs = recs + (size_t)i * per;
        w[i].n = per;
        int rc = pthread_create(&w[i].th, NULL, fn, &w[i]);
        if (rc) {
            fprintf(stderr, "pthread_create: %d\n", rc);
            exit(2);
        }
    }
}

static void join_workers(struct worker *w, int n) {
    for (int i = 0; i < n; i++) pthread_join(w[i].th, NULL);
}

/* ---- one run of a scenario: a core, its records, its workers ------------------------ */

struct run {
    struct trec *recs;
    size_t n;
    struct worker w[NTHREADS];
    bt_stats s;   /* the core's counters, read by run_tally() */
    struct tally t;
};

/* Fresh globals, a core (with G.port if asked) and n records; `parties`
 * threads meet at G.barrier. */
static void run_open(struct run *r, int with_port, unsigned parties, size_t n) {
    memset(r, 0, sizeof(*r));
    reset_state(parties);
    make_core(with_port);
    r->recs = alloc_recs(n);
    r->n = n;
}

/* NTHREADS workers running fn over `per` records each, released at once
 * (the caller is the last party of the barrier). */
static void run_workers(struct run *r, void *(*fn)(void *), size_t per) {
    start_workers(r->w, NTHREADS, fn, r->recs, per);
    pthread_barrier_wait(&G.barrier);
}

/* The workers are done and every timer they made is run or cancelled. */
static void run_join(struct run *r) {
    join_workers(r->w, NTHREADS);
    CHECK(wait_accounted());
    CHECK(wait_core_settled());
}

/* The core's counters and the records' tally, read once all is still. */
static void run_tally(struct run *r) {
    bt_get_stats(G.tt, &r->s);
    check_records(r->recs, r->n, &r->t);
}

/* What holds after every run: no record broke a rule, the core ran what the
 * callbacks saw run, nothing fired early, no call returned an error. */
static void check_run(const struct run *r) {
    CHECK(r->t.violations == 0);
    CHECK(r->s.ran == r->t.ran);
    CHECK(r->s.early_fires == 0);
    CHECK(atomic_load(&G.errors) == 0);
}

static void run_close(struct run *r) {
    if (checks_failed_in_test) print_stats("stats", &r->s);
    bt_destroy(G.tt);
    free(r->recs);
    pthread_barrier_destroy(&G.barrier);
}

/* ---- 1. native timers, RPC shape ----------------------------------------------- */

static void *s1_worker(void *arg) {
    struct worker *w = arg;
    struct dqueue q;
    dq_init(&q, w->n);
    pthread_barrier_wait(&G.barrier);
    int64_t start = 0, mark = 0;
    for (size_t i = 0; i < w->n; i++) {
        /* Deadlines cluster on 8 values 2 ms after a start that moves every
         * 256 timers, so most are still in the future when scheduled and many
         * tie across threads. */
        if (i % 256 == 0) start = bt_now_ns();
        struct trec *r = &w->recs[i];
        r->kind = K_PLAIN;
        r->deadline = start + 2 * MS + (int64_t)(i % 8) * US;
        uint64_t id;
        int rc = bt_schedule_native(G.tt, r->deadline, on_fire, r, &id);
        if (rc) {
            count_error("bt_schedule_native", rc);
            continue;
        }
        publish(r, id);
        unsigned x = (unsigned)rand_r(&w->seed) % 100;
        if (x < 20) { /* right away, sometimes twice */
            owner_cancel(r);
            if (x < 8) owner_cancel(r);
        } else if (x < 30) { /* after a short spin */
            spin_until(bt_now_ns() + (int64_t)(rand_r(&w->seed) % 30) * US);
            owner_cancel(r);
            if (x < 24) owner_cancel(r);
        } else if (x < 50) { /* around the deadline, racing the fire */
            int64_t at = r->deadline - 300 * US + (int64_t)(rand_r(&w->seed) % 600) * US;
            dq_push(&q, r, at, x < 36);
        }
        dq_run(&q, 0);
        pace(i, &mark);
    }
    dq_run(&q, 1);
    free(q.v);
    return NULL;
}

static void scenario_native_rpc(void) {
    size_t K = scaled(20000);
    struct run r;
    run_open(&r, 0, NTHREADS + 1, NTHREADS * K);
    run_workers(&r, s1_worker, K);
    run_join(&r);

    CHECK(bt_stop(G.tt) == 0);
    CHECK(bt_drop_all(G.tt, on_drop, NULL) == 0);
    run_tally(&r);
    const bt_stats *s = &r.s;
    const struct tally *t = &r.t;
    check_run(&r);
    CHECK(t->scheduled == NTHREADS * K);
    CHECK(s->scheduled == NTHREADS * K);
    CHECK(s->ran == atomic_load(&G.completed));
    CHECK(s->fired == t->ran);
    CHECK(s->cancelled == t->won);
    double p50, mx;
    lateness(s, &p50, &mx);
    printf("  native_rpc: %zu timers, ran %zu, cancel won %zu (first cancel: won %zu, too-late %zu, "
           "unknown %zu), passes %llu, wakeups %llu, lateness p50 < %.0f us, max < %.0f us\n",
           t->scheduled, t->ran, t->won, t->first_won, t->first_late, t->first_unknown,
           (ull)s->passes, (ull)s->wakeups, p50, mx);
    run_close(&r);
}

/* ---- 2. scheduling and cancelling from callbacks -------------------------------- */

#define S2_GROUP 4 /* records per group: a chain uses all four */

static void *s2_worker(void *arg) {
    struct worker *w = arg;
    size_t groups = w->n / S2_GROUP;
    struct dqueue q;
    dq_init(&q, 2 * groups + 2 * (groups / 8 + 1));
    pthread_barrier_wait(&G.barrier);
    int64_t start = 0, mark = 0;
    for (size_t g = 0; g < groups; g++) {
        if (g % 64 == 0) start = bt_now_ns();
        struct trec *r = &w->recs[g * S2_GROUP];
        int64_t base = start + 1 * MS + (int64_t)(rand_r(&w->seed) % 1000) * US;
        unsigned x = (unsigned)rand_r(&w->seed) % 100;
        uint64_t id;
        int rc;
        if (x < 40) {
            /* A chain of depth 3: r[0] schedules r[1] from its callback, and
             * so on down to r[3].  Children are cancelled by revisits below. */
            for (int d = 0; d < S2_GROUP; d++) {
                r[d].kind = K_CHAIN;
                r[d].depth = d;
                r[d].next = d + 1 < S2_GROUP ? &r[d + 1] : NULL;
            }
            r[0].deadline = base;
            rc = bt_schedule_native(G.tt, r[0].deadline, on_fire, &r[0], &id);
            if (rc) {
                count_error("bt_schedule_native", rc);
                continue;
            }
            publish(&r[0], id);
            if (x < 8) owner_cancel(&r[0]);
        } else if (x < 75) {
            /* A canceller A and its target B: A's callback cancels B.  B is
             * scheduled after A (so with an equal deadline it fires after A)
             * and sometimes also cancelled by this thread around its
             * deadline, racing the callback. */
            static const int64_t delta[4] = {-1 * US, 0, 1 * US, 50 * US};
            struct trec *a = &r[0], *b = &r[1];
            int64_t dd = delta[rand_r(&w->seed) % 4];
            a->kind = K_CANCELLER;
            a->next = b;
            a->deadline = base;
            b->kind = K_TARGET;
            b->multi = 1;
            b->deadline = base + dd;
            b->strict = dd >= 0;
            rc = bt_schedule_native(G.tt, a->deadline, on_fire, a, &id);
            if (rc) {
                count_error("bt_schedule_native", rc);
                continue;
            }
            publish(a, id);
            rc = bt_schedule_native(G.tt, b->deadline, on_fire, b, &id);
            if (rc) {
                count_error("bt_schedule_native", rc);
                continue;
            }
            publish(b, id);
            if (x < 50)
                dq_push(&q, b, b->deadline - 100 * US + (int64_t)(rand_r(&w->seed) % 200) * US,
                        x < 45);
        } else {
            r[0].kind = K_PLAIN;
            r[0].deadline = base;
            rc = bt_schedule_native(G.tt, r[0].deadline, on_fire, &r[0], &id);
            if (rc) {
                count_error("bt_schedule_native", rc);
                continue;
            }
            publish(&r[0], id);
            if (x < 85) owner_cancel(&r[0]);
            else if (x < 90) dq_push(&q, &r[0], base + (int64_t)(rand_r(&w->seed) % 100) * US, 1);
        }
        /* Revisit an earlier group: cancel a child a callback scheduled, if
         * its id is out yet, racing its fire on the timer thread. */
        if (g % 8 == 7) {
            struct trec *o = &w->recs[(rand_r(&w->seed) % (g + 1)) * S2_GROUP];
            if (o[0].kind == K_CHAIN) {
                struct trec *c = &o[1 + rand_r(&w->seed) % (S2_GROUP - 1)];
                if (atomic_load_explicit(&c->id, memory_order_acquire)) {
                    owner_cancel(c);
                    if (rand_r(&w->seed) % 2) owner_cancel(c);
                }
            }
        }
        dq_run(&q, 0);
        pace(g, &mark);
    }
    dq_run(&q, 1);
    free(q.v);
    return NULL;
}

static void scenario_from_callbacks(void) {
    size_t per = scaled(3000) * S2_GROUP;
    struct run r;
    run_open(&r, 0, NTHREADS + 1, NTHREADS * per);
    run_workers(&r, s2_worker, per);
    run_join(&r);

    CHECK(bt_stop(G.tt) == 0);
    CHECK(bt_drop_all(G.tt, on_drop, NULL) == 0);
    run_tally(&r);
    const bt_stats *s = &r.s;
    const struct tally *t = &r.t;
    size_t chains_done = 0, targets = 0;
    for (size_t i = 0; i < r.n; i++) {
        const struct trec *rec = &r.recs[i];
        if (rec->kind == K_CHAIN && rec->depth == S2_GROUP - 1 && atomic_load(&rec->runs))
            chains_done++;
        if (rec->kind == K_TARGET) targets++;
    }
    check_run(&r);
    CHECK(s->scheduled == atomic_load(&G.scheduled));
    CHECK(t->scheduled == atomic_load(&G.scheduled));
    CHECK(s->ran == atomic_load(&G.completed));
    CHECK(s->fired == t->ran);
    CHECK(s->cancelled == t->won);
    CHECK(atomic_load(&G.cb_scheduled) > 0);
    printf("  from_callbacks: %zu timers (%llu scheduled from callbacks, %zu chains complete), ran %zu, "
           "cancel won %zu (%zu by callbacks, %zu callback cancels too late, %llu skipped), "
           "%zu targets\n",
           t->scheduled, (ull)atomic_load(&G.cb_scheduled), chains_done, t->ran, t->won, t->cb_won,
           t->cb_late, (ull)atomic_load(&G.cancel_skipped), targets);
    run_close(&r);
}

/* ---- 3. the ports path ------------------------------------------------------------ */

static void *s3_worker(void *arg) {
    struct worker *w = arg;
    struct dqueue q;
    dq_init(&q, w->n);
    pthread_barrier_wait(&G.barrier);
    int64_t mark = 0;
    for (size_t i = 0; i < w->n; i++) {
        struct trec *r = &w->recs[i];
        r->is_port = 1;
        r->deadline = bt_now_ns() + 200 * US + (int64_t)(rand_r(&w->seed) % 1000) * US;
        uint64_t id;
        int rc = bt_schedule_port(G.tt, r->deadline, G.port, r, &id);
        if (rc) {
            count_error("bt_schedule_port", rc);
            continue;
        }
        publish(r, id);
        unsigned x = (unsigned)rand_r(&w->seed) % 100;
        if (x < 20) {
            owner_cancel(r);
            if (x < 6) owner_cancel(r);
        } else if (x < 50) {
            /* Mostly after the deadline: lands on POSTED or RUNNING. */
            int64_t at = r->deadline - 50 * US + (int64_t)(rand_r(&w->seed) % 500) * US;
            dq_push(&q, r, at, x < 30);
        }
        dq_run(&q, 0);
        pace(i, &mark);
    }
    dq_run(&q, 1);
    free(q.v);
    return NULL;
}

static void scenario_ports(void) {
    size_t K = scaled(8000);
    struct run r;
    run_open(&r, 1, NTHREADS + 1, NTHREADS * K);
    atomic_store(&G.slow_consumer, 1);
    pthread_t consumer;
    if (pthread_create(&consumer, NULL, consumer_main, NULL)) exit(2);
    run_workers(&r, s3_worker, K);
    run_join(&r);
    atomic_store(&G.stop_consumer, 1);
    pthread_join(consumer, NULL);

    CHECK(bt_stop(G.tt) == 0);
    CHECK(bt_drop_all(G.tt, on_drop, NULL) == 0);
    size_t left = 0;
    CHECK(drain_port(G.port, &left) == 0);
    CHECK(left == 0);
    CHECK(drain_port(bt_orphans(G.tt), &left) == 0 && left == 0);
    run_tally(&r);
    const bt_stats *s = &r.s;
    const struct tally *t = &r.t;
    check_run(&r);
    CHECK(t->scheduled == NTHREADS * K);
    CHECK(s->scheduled == NTHREADS * K);
    CHECK(s->ran == atomic_load(&G.completed));
    CHECK(s->posted == s->fired);
    CHECK(s->posted == t->ran + atomic_load(&G.claim_failed));
    CHECK(s->cancelled == t->won);
    printf("  ports: %zu timers, ran %zu, cancel won %zu (%llu of them on POSTED timers), "
           "first cancel too-late %zu / unknown %zu, eventfd writes %llu\n",
           t->scheduled, t->ran, t->won, (ull)atomic_load(&G.claim_failed), t->first_late,
           t->first_unknown, (ull)s->eventfd_writes);
    run_close(&r);
}

/* ---- 4. bt_stop racing schedules -------------------------------------------------- */

static void *s4_worker(void *arg) {
    struct worker *w = arg;
    struct dqueue q;
    dq_init(&q, w->n);
    pthread_barrier_wait(&G.barrier);
    int64_t mark = 0;
    for (size_t i = 0; i < w->n; i++) {
        struct trec *r = &w->recs[i];
        unsigned x = (unsigned)rand_r(&w->seed) % 100;
        r->is_port = x % 2;
        int64_t now = bt_now_ns();
        r->deadline = x < 60 ? now + (int64_t)(rand_r(&w->seed) % 1000) * US : now + 10000 * MS;
        if (x < 10 && i + 3 < w->n) {
            /* A native chain of depth 3 (using the next three records):
             * its callbacks schedule while bt_stop runs. */
            r->is_port = 0;
            for (int d = 0; d < 4; d++) {
                r[d].kind = K_CHAIN;
                r[d].depth = d;
                r[d].next = d < 3 ? &r[d + 1] : NULL;
            }
        }
        uint64_t id;
        int rc = r->is_port ? bt_schedule_port(G.tt, r->deadline, G.port, r, &id)
                            : bt_schedule_native(G.tt, r->deadline, on_fire, r, &id);
        if (rc == -ESHUTDOWN) {
            atomic_fetch_add(&G.shutdown_seen, 1);
            break;
        }
        if (rc) {
            count_error("bt_schedule_*", rc);
            continue;
        }
        if (atomic_load(&G.stop_returned)) atomic_fetch_add(&G.sched_after_stop, 1);
        publish(r, id);
        x = (unsigned)rand_r(&w->seed) % 100;
        if (x < 20) {
            owner_cancel(r);
            if (x < 5) owner_cancel(r);
        } else if (x < 50) {
            dq_push(&q, r, now + (int64_t)(rand_r(&w->seed) % 1500) * US, x < 30);
        }
        dq_run(&q, 0);
        pace(i, &mark);
        if (r->kind == K_CHAIN) i += 3;
    }
    /* Whatever is left is cancelled now, after bt_stop: still allowed. */
    for (size_t i = q.head; i < q.tail; i++) q.v[i].at = 0;
    dq_run(&q, 1);
    free(q.v);
    return NULL;
}

/* Workers schedule (native and port timers, near and far) and cancel while
 * the main thread calls bt_stop; then bt_drop_all.  drop_before_join calls
 * the first bt_drop_all before joining the workers (the known race of
 * scenario_stop_inflight_drop); otherwise only after. */
static void run_stop_race(int drop_before_join, size_t *leaked_out) {
    size_t K = scaled(40000);
    struct run r;
    run_open(&r, 1, NTHREADS + 1, NTHREADS * K);
    struct trec *recs = r.recs;
    pthread_t consumer;
    if (pthread_create(&consumer, NULL, consumer_main, NULL)) exit(2);
    run_workers(&r, s4_worker, K);
    /* Stop once the workers are well under way (or after 300 ms). */
    uint64_t target = NTHREADS * K / 5;
    int64_t end = bt_now_ns() + 300 * MS;
    while (atomic_load(&G.scheduled) < target && bt_now_ns() < end) usleep(200);
    atomic_store(&G.stopping, 1);
    CHECK(bt_stop(G.tt) == 0);
    atomic_store(&G.stop_returned, 1);
    CHECK(bt_is_stopped(G.tt));
    uint64_t id;
    CHECK(bt_schedule_native(G.tt, 0, on_fire, &recs[0], &id) == -ESHUTDOWN);
    CHECK(bt_schedule_port(G.tt, 0, G.port, &recs[0], &id) == -ESHUTDOWN);
    CHECK(bt_stop(G.tt) == 0); /* idempotent */
    /* Ports keep working after stop: the consumer may still claim what was
     * posted until here.  It is joined before any bt_drop_all (see
     * scenario_drop_vs_consumer for why). */
    usleep(2000);
    atomic_store(&G.stop_consumer, 1);
    pthread_join(consumer, NULL);
    int64_t dropped1 = 0, dropped2 = 0;
    if (drop_before_join) dropped1 = bt_drop_all(G.tt, on_drop, NULL);
    join_workers(r.w, NTHREADS);
    uint64_t runs_before_drop = atomic_load(&G.completed);
    size_t leaked = 0;
    if (drop_before_join) {
        /* Every timer is now ran / cancelled / dropped, or still pending in a
         * port: count the ones that are none of these and not posted. */
        for (size_t i = 0; i < r.n; i++) {
            const struct trec *rec = &recs[i];
            if (atomic_load(&rec->scheduled) && !atomic_load(&rec->runs) &&
                !atomic_load(&rec->wins) && !atomic_load(&rec->dropped))
                leaked++;
        }
    }
    dropped2 = bt_drop_all(G.tt, on_drop, NULL);
    CHECK(dropped1 >= 0 && dropped2 >= 0);
    size_t popped = 0;
    size_t claimed_after_drop = drain_port(G.port, &popped);
    CHECK(claimed_after_drop == 0); /* drop_all cancelled every POSTED timer */
    CHECK(bt_drop_all(G.tt, on_drop, NULL) == 0);
    run_tally(&r);
    const bt_stats *s = &r.s;
    const struct tally *t = &r.t;
    check_run(&r);
    CHECK((uint64_t)(dropped1 + dropped2) == atomic_load(&G.drops));
    CHECK(atomic_load(&G.null_drops) == 0);
    CHECK(t->dropped == (size_t)(dropped1 + dropped2));
    CHECK(t->scheduled == atomic_load(&G.scheduled));
    CHECK(s->scheduled == t->scheduled);
    CHECK(s->ran == runs_before_drop);
    CHECK(s->cancelled == t->won + t->dropped);
    printf("  stop_race%s: %zu scheduled before stop (%llu from callbacks), %llu schedules saw "
           "-ESHUTDOWN (%llu in callbacks), ran %zu, cancel won %zu, dropped %zu (%lld + %lld), "
           "%llu schedules returned 0 after bt_stop returned\n",
           drop_before_join ? "(drop before join)" : "", t->scheduled,
           (ull)atomic_load(&G.cb_scheduled), (ull)atomic_load(&G.shutdown_seen),
           (ull)atomic_load(&G.shutdown_seen_cb), t->ran, t->won, t->dropped, (long long)dropped1,
           (long long)dropped2, (ull)atomic_load(&G.sched_after_stop));
    if (leaked_out) *leaked_out = leaked;
    run_close(&r);
}

static void scenario_stop_race(void) { run_stop_race(0, NULL); }

/* ---- 5. garbage churn: drains, prunes and sweeps under cross-thread cancels -- */

/* Far-future timers, nearly all cancelled: bucket lists hit the drain
 * threshold (and, when the timer thread lags, the in-place prune).  A tenth
 * of the cancels are handed to the next worker through a slot array, so
 * slots are cancelled by a thread other than the one whose bucket holds them
 * (whoever takes a record out of a hand-off slot is its only canceller).
 * Another quarter is cancelled only after the loop, once drained into the
 * heap; then one due timer makes the thread collect, and the heap, mostly
 * dead by then, is swept. */
#define HANDOFF 64
static _Atomic(struct trec *) handoff[NTHREADS][HANDOFF];

static void take_handoffs(int from) {
    for (int k = 0; k < HANDOFF; k++) {
        struct trec *r = atomic_exchange(&handoff[from][k], NULL);
        if (r) owner_cancel(r);
    }
}

static void *s5_worker(void *arg) {
    struct worker *w = arg;
    struct dqueue q;
    dq_init(&q, w->n);
    pthread_barrier_wait(&G.barrier);
    int64_t mark = 0, far = bt_now_ns() + 3600LL * 1000 * MS;
    for (size_t i = 0; i < w->n; i++) {
        struct trec *r = &w->recs[i];
        r->is_port = i % 4 == 0;
        r->deadline = far + (int64_t)(rand_r(&w->seed) % 1000000);
        uint64_t id;
        int rc = r->is_port ? bt_schedule_port(G.tt, r->deadline, G.port, r, &id)
                            : bt_schedule_native(G.tt, r->deadline, on_fire, r, &id);
        if (rc) {
            count_error("bt_schedule_*", rc);
            continue;
        }
        publish(r, id);
        unsigned x = (unsigned)rand_r(&w->seed) % 100;
        if (x < 55) {
            owner_cancel(r);
            if (x < 5) owner_cancel(r);
        } else if (x < 65) {
            struct trec *old = atomic_exchange(&handoff[w->idx][rand_r(&w->seed) % HANDOFF], r);
            if (old) owner_cancel(old);
        } else if (x < 90) {
            dq_push(&q, r, 0, x < 70);
        }
        if (i % 16 == 15) take_handoffs((w->idx + 1) % NTHREADS);
        pace(i, &mark);
    }
    pthread_barrier_wait(&G.barrier); /* main saw everything scheduled */
    dq_run(&q, 1);
    free(q.v);
    return NULL;
}

static void scenario_garbage_churn(void) {
    size_t K = scaled(30000);
    struct run r;
    run_open(&r, 1, NTHREADS + 1, NTHREADS * K + 1);
    for (int i = 0; i < NTHREADS; i++)
        for (int k = 0; k < HANDOFF; k++) atomic_init(&handoff[i][k], NULL);
    struct trec *trigger = &r.recs[NTHREADS * K];
    run_workers(&r, s5_worker, K);
    uint64_t max_list = 0;
    bt_stats s;
    for (;;) {
        bt_get_stats(G.tt, &s);
        if (s.list_size > max_list) max_list = s.list_size;
        if (s.scheduled >= NTHREADS * K || atomic_load(&G.errors)) break;
        usleep(2000);
    }
    pthread_barrier_wait(&G.barrier); /* the late cancels start */
    join_workers(r.w, NTHREADS);
    for (int i = 0; i < NTHREADS; i++) take_handoffs(i);
    /* One due timer: the thread collects what the lists still hold and
     * sweeps the heap. */
    trigger->deadline = bt_now_ns();
    uint64_t id;
    CHECK(bt_schedule_native(G.tt, trigger->deadline, on_fire, trigger, &id) == 0);
    publish(trigger, id);
    int64_t end = bt_now_ns() + QUIESCE_TIMEOUT;
    while (!atomic_load(&trigger->runs) && bt_now_ns() < end) usleep(1000);
    CHECK(atomic_load(&trigger->runs) == 1);
    /* The sweep runs in slices after the pass that fired the trigger: give
     * it until the quiesce timeout. */
    do {
        usleep(2000);
        bt_get_stats(G.tt, &s);
    } while (K >= 20000 && s.sweeps == 0 && bt_now_ns() < end);
    uint64_t reaped_before_stop = s.reaped, drains = s.drains, sweeps = s.sweeps;
    /* A sweep needs a heap of at least sweep_min (BT_DEFAULT_SWEEP_MIN)
     * entries, more than half of them dead: about 0.3 * 4 * K of them are,
     * when K is big. */
    if (K >= 20000) CHECK(sweeps >= 1);

    CHECK(bt_stop(G.tt) == 0);
    int64_t dropped = bt_drop_all(G.tt, on_drop, NULL);
    size_t left = 0;
    CHECK(drain_port(G.port, &left) == 0 && left == 0); /* nothing was ever due */
    run_tally(&r);
    const struct tally *t = &r.t;
    check_run(&r);
    CHECK(t->scheduled == NTHREADS * K + 1);
    CHECK(r.s.scheduled == NTHREADS * K + 1);
    CHECK(t->ran == 1 && r.s.fired == 1);
    CHECK((size_t)dropped == t->dropped && t->won + t->dropped + 1 == t->scheduled);
    CHECK(r.s.cancelled == t->won + t->dropped);
    CHECK(atomic_load(&G.null_drops) == 0);
    printf("  garbage_churn: %zu timers, cancel won %zu (first: %zu), dropped %zu, reaped before "
           "stop %llu, drains %llu, sweeps %llu, max list %llu, slots %llu\n",
           t->scheduled, t->won, t->first_won, t->dropped, (ull)reaped_before_stop, (ull)drains,
           (ull)sweeps, (ull)max_list, (ull)r.s.slots);
    run_close(&r);
}

/* ---- regression scenarios for two fixed races ----------------------------------- */

/* bt_drop_all while a port consumer runs.  An earlier core read t->port and
 * t->arg after its CAS to CANCELLED, when the consumer could already have
 * refused the claim and released (and cleared) the slot: TSan reported it,
 * and on_drop saw (NULL, NULL).  The core now reads them before the CAS. */
static void *s6_consumer(void *arg) {
    (void)arg;
    pthread_barrier_wait(&G.barrier);
    bt_timer *t;
    while ((t = bt_port_pop(G.port)) != NULL) consume_one(G.port, t, NULL);
    return NULL;
}

static void scenario_drop_vs_consumer(void) {
    int rounds = (int)scaled(20);
    size_t N = 2000;
    uint64_t null_drops = 0, drops = 0;
    struct tally t = {0};
    for (int round = 0; round < rounds; round++) {
        struct run r;
        run_open(&r, 1, 2, N);
        struct trec *recs = r.recs;
        int64_t now = bt_now_ns();
        for (size_t i = 0; i < N; i++) {
            uint64_t id;
            recs[i].is_port = 1;
            recs[i].deadline = now;
            CHECK(bt_schedule_port(G.tt, now, G.port, &recs[i], &id) == 0);
            publish(&recs[i], id);
        }
        bt_stats s;
        int64_t end = bt_now_ns() + QUIESCE_TIMEOUT;
        do {
            usleep(500);
            bt_get_stats(G.tt, &s);
        } while (s.posted < N && bt_now_ns() < end);
        CHECK(bt_stop(G.tt) == 0);
        pthread_t c;
        if (pthread_create(&c, NULL, s6_consumer, NULL)) exit(2);
        pthread_barrier_wait(&G.barrier);
        bt_drop_all(G.tt, on_drop, NULL);
        pthread_join(c, NULL);
        drain_port(G.port, NULL);
        check_records(recs, N, &t);
        null_drops += atomic_load(&G.null_drops);
        drops += atomic_load(&G.drops);
        run_close(&r);
    }
    printf("  drop_vs_consumer: %d rounds, ran %zu, dropped %llu, on_drop got NULL payload %llu times\n",
           rounds, t.ran, (ull)drops, (ull)null_drops);
    CHECK(null_drops == 0);
    CHECK(t.violations == 0 || null_drops > 0); /* NULL drops are not counted on the record */
}

/* bt_drop_all right after bt_stop, while workers may still be inside a
 * schedule that passed the stop check: such a timer becomes PENDING after
 * drop_all looked at its slot, so it is never run, cancelled or dropped (a
 * second bt_drop_all after the join finds it). */
static void scenario_stop_inflight_drop(void) {
    size_t total = 0;
    int rounds = (int)scaled(3);
    for (int i = 0; i < rounds; i++) {
        size_t leaked = 0;
        run_stop_race(1, &leaked);
        total += leaked;
    }
    printf("  stop_inflight_drop: %zu timers missed by a bt_drop_all that ran right after bt_stop\n",
           total);
    CHECK(total == 0);
}

/* ---- detach while the timer thread posts ------------------------------------------ */

/* What the consumer of a closed loop does: takes every timer the port holds
 * and releases it without running it.  Returns how many it took. */
static size_t take_all(bt_port *port) {
    size_t n = 0;
    bt_port_ack(port);
    bt_timer *t;
    while ((t = bt_port_pop(port)) != NULL) {
        struct trec *r = bt_timer_payload(t);
        if (bt_timer_take(port, t)) atomic_fetch_add(&r->dropped, 1);
        else count_error("bt_timer_take refused an uncancelled timer", 0);
        bt_timer_release(port, t);
        n++;
    }
    return n;
}

/* A loop closes while its timers fall due: the port is detached and drained
 * (bt_timer_take) while the timer thread pops and posts a batch for it.
 * Every timer must be taken exactly once, from the port by that drain or
 * from the orphan port; none may be pushed to the port after the drain,
 * where nobody would ever take it.  An earlier core decided "detached or
 * not" when it staged a timer and pushed the batch later, so a detach
 * between the two left part of the batch in the detached port. */
static void scenario_detach_vs_post(void) {
    int rounds = (int)scaled(24);
    size_t N = 50000;
    size_t stranded = 0, from_port = 0, from_orphans = 0;
    struct tally t = {0};
    for (int round = 0; round < rounds; round++) {
        struct run r;
        run_open(&r, 1, 1, N);
        bt_port *orphans = bt_orphans(G.tt);
        struct trec *recs = r.recs;
        int64_t deadline = bt_now_ns() + 5 * MS;
        for (size_t i = 0; i < N; i++) {
            uint64_t id;
            recs[i].is_port = 1;
            recs[i].deadline = deadline;
            CHECK(bt_schedule_port(G.tt, deadline, G.port, &recs[i], &id) == 0);
            publish(&recs[i], id);
        }
        /* Detach somewhere between just before the deadline and the end of
         * the pass that posts the batch (about 2 ms in a plain -O2 build). */
        wait_until(deadline - 200 * US + (int64_t)(round % 12) * 200 * US);
        CHECK(bt_port_detach(G.port) == 0);
        size_t a = take_all(G.port), b = 0, left = 0;
        int64_t end = bt_now_ns() + QUIESCE_TIMEOUT;
        while (a + b + left < N && bt_now_ns() < end) {
            usleep(500);
            b += take_all(orphans);
            left += take_all(G.port);
        }
        bt_stats s;
        bt_get_stats(G.tt, &s);
        CHECK(s.fired == N && s.slots_free == s.slots);
        CHECK(s.scheduled == s.ran + s.cancelled + s.dropped && s.dropped == a + b + left);
        check_records(recs, N, &t);
        from_port += a;
        from_orphans += b;
        stranded += left;
        CHECK(bt_stop(G.tt) == 0);
        run_close(&r);
    }
    printf("  detach_vs_post: %d rounds of %zu timers: taken from the port by the detach drain "
           "%zu, from the orphan port %zu, pushed to the port after its drain %zu\n",
           rounds, N, from_port, from_orphans, stranded);
    CHECK(stranded == 0);
    CHECK(t.violations == 0);
    CHECK(atomic_load(&G.errors) == 0);
}

/* ---- main ------------------------------------------------------------------------- */

struct scenario {
    const char *name;
    void (*fn)(void);
};

int main(int argc, char **argv) {
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] >= 'a' && argv[i][0] <= 'z') only = argv[i];
        else scale = atof(argv[i]);
    }
    if (!(scale > 0)) scale = 1.0;
    setvbuf(stdout, NULL, _IOLBF, 0);

    struct scenario scenarios[] = {
        {"native_rpc", scenario_native_rpc},
        {"from_callbacks", scenario_from_callbacks},
        {"ports", scenario_ports},
        {"stop_race", scenario_stop_race},
        {"garbage_churn", scenario_garbage_churn},
        {"drop_vs_consumer", scenario_drop_vs_consumer},
        {"stop_inflight_drop", scenario_stop_inflight_drop},
        {"detach_vs_post", scenario_detach_vs_post},
    };
    int passed = 0;
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++) {
        if (only && strcmp(only, scenarios[i].name) != 0) continue;
        checks_failed_in_test = 0;
        int64_t t0 = bt_now_ns();
        scenarios[i].fn();
        double secs = (double)(bt_now_ns() - t0) / 1e9;
        printf("%s %s (%.2f s)\n", checks_failed_in_test ? "FAIL" : "ok  ", scenarios[i].name,
               secs);
        if (checks_failed_in_test) failures++;
        else passed++;
    }
    printf("%d passed, %d failed\n", passed, failures);
    return failures ? 1 : 0;
}
