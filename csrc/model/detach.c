/*
 * detach.c -- model check: a port's detach against the timer thread's post
 * (csrc/port.c's header comment; docs/design.rst, rule 8).
 *
 * Property: no read or write reaches the port's fd once it is closed, and
 * when bt_port_detach returns, every post the port will ever get has
 * happened before it (so a drain after detach takes them all, and what
 * falls due later goes to the orphan port).
 *
 * Code under test: enter, write_signal and leave (the post) and
 * bt_port_detach, wait_out and close_fd, as they are in csrc/port.c.
 * Stubbed (the OS only): write() and close() record whether a write came
 * after the close.  Not run: push_chain, the Treiber stack itself, whose
 * links are pointers to memory threads share, which CBMC refuses to store
 * ("pointer handling for concurrency is unsound"); the post here writes a
 * flag where push_chain pushes, between the same enter and leave.
 *
 * Detach waits for the users to leave in a spin (yield, then sleep).  A
 * spin's failed reads change nothing, so every run of it is equivalent to
 * one whose first read already sees 0, taken later: the model copy waits
 * with an assumption instead, which keeps the loop bound small.
 * adapt port.c: for (unsigned i = 0; atomic_load(count) != 0; i++) { => __CPROVER_assume(atomic_load(count) == 0);\n    for (unsigned i = 0; 0; i++) {
 *
 * Threads and bounds: the timer thread's one post against one detach: 2
 * threads.  Each side stores, then loads what the other stored (a
 * store-buffer pattern, which only seq_cst orders).  Under PSO the check
 * passes, but no weakened ordering here can fail it: CBMC's PSO never lets
 * a read-modify-write (enter's count) pass a later load, as an x86 locked
 * instruction never does, so the post's side is always ordered; the
 * mutations below are steps dropped, caught under SC, and one of them
 * under PSO too (sc+weak), to show the PSO run can fail.
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation no-wait sc+weak port.c: wait_out(&port->users); => (void)0;
 * mutation enter-ignores-detach sc port.c: if (!atomic_load(&port->detached)) return 1; => return 1;
 */
#include "model.h"

#include "../port.c"

static bt_timer_thread core;
static bt_port port;
_Atomic uint64_t bt__fork_generation;
static int fd_closed, written_after_close, posted, posted_seen, detach_rc;
static volatile int done_post;

ssize_t write(int fd, const void *buf, size_t n) {
    (void)fd, (void)buf;
    __CPROVER_atomic_begin();
    if (fd_closed) written_after_close = 1;
    __CPROVER_atomic_end();
    return (ssize_t)n;
}

int close(int fd) {
    (void)fd;
    __CPROVER_atomic_begin();
    fd_closed = 1;
    __CPROVER_atomic_end();
    return 0;
}

/* bt__port_post, with a flag where push_chain pushes (see above). */
static void timer_thread(void) {
    if (enter(&port)) {
        posted = 1;
        write_signal(&port);
        leave(&port);
    }
    model_done(&done_post);
}

int main(void) {
    port.tt = &core;
    port.fd = 3;
__CPROVER_ASYNC_1:
    timer_thread();
    detach_rc = bt_port_detach(&port);
    posted_seen = posted;
    model_join(done_post);

    __CPROVER_assert(detach_rc == 0, "detach succeeds");
    __CPROVER_assert(!written_after_close, "no write reaches a closed fd");
    __CPROVER_assert(!posted || posted_seen, "every post happened before detach returned");
    return 0;
}
