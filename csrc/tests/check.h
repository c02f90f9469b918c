/*
 * check.h -- the C tests' assertion and runner: CHECK(cond) reports a failed
 * condition with its place and counts it for the running test, and the test
 * goes on (the count is atomic: stress scenarios check from worker
 * threads); run_tests() runs a table of tests and prints "N passed, N
 * failed"; manual_core() makes a core on the manual clock (rule 9 of
 * docs/design.rst), which the deterministic tests drive with bt_advance,
 * threaded_core() one with its own timer thread, open_port() a port of
 * either; thread_count() counts the process's threads.
 */
#ifndef BT_TESTS_CHECK_H
#define BT_TESTS_CHECK_H

#include <stdatomic.h>
#include <stdio.h>

static _Atomic int checks_failed_in_test;
static int failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            atomic_fetch_add(&checks_failed_in_test, 1);                             \
        }                                                                            \
    } while (0)

struct test {
    const char *name;
    void (*fn)(void);
};

/* Runs each test, prints ok/FAIL and its name, and the totals; the exit
 * status for main(). */
static inline int run_tests(const struct test *tests, size_t n) {
    int passed = 0;
    for (size_t i = 0; i < n; i++) {
        checks_failed_in_test = 0;
        tests[i].fn();
        printf("%s %s\n", checks_failed_in_test ? "FAIL" : "ok  ", tests[i].name);
        if (checks_failed_in_test) failures++;
        else passed++;
    }
    printf("%d passed, %d failed\n", passed, failures);
    return failures ? 1 : 0;
}

#define RUN_TESTS(table) run_tests((table), sizeof(table) / sizeof((table)[0]))

/* The process's threads (Linux: /proc/self/status), -1 if unknown. */
static inline int thread_count(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    if (f) fclose(f);
    return n;
}

#ifdef BUCKETIMER_H
/* A core with no thread whose clock starts at start_ns. */
static inline bt_timer_thread *manual_core(int64_t start_ns) {
    bt_options o;
    bt_options_init(&o);
    o.manual_clock = 1;
    o.manual_start_ns = start_ns;
    bt_timer_thread *tt = NULL;
    int rc = bt_create(&o, &tt);
    CHECK(rc == 0 && tt);
    return tt;
}

/* A core with its own timer thread, on the default options. */
static inline bt_timer_thread *threaded_core(void) {
    bt_timer_thread *tt = NULL;
    CHECK(bt_create(NULL, &tt) == 0 && tt);
    return tt;
}

/* A port of tt whose fd is signalled when timers are posted to it. */
static inline bt_port *open_port(bt_timer_thread *tt) {
    bt_port *p = NULL;
    CHECK(bt_port_open(tt, 1, &p) == 0 && p);
    return p;
}
#endif

#endif
