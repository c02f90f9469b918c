/*
 * test_wake_socket.c -- a port that signals a socket it does not read
 * (bt_port_wake_by; docs/design.rst, "Waking a stock loop"): one zero byte
 * per round of posts, into a dup of the socket the caller gave; an ack that
 * reads nothing; a signal that came before the fd is sent once it comes;
 * nothing sent after a detach, which closes the dup and only the dup; a
 * closed peer is no SIGPIPE.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bucketimer.h"

#include "check.h"

/* Bytes waiting on `fd` (read and counted), each checked to be zero. */
static int take_bytes(int fd) {
    char buf[64];
    int n = 0;
    ssize_t r;
    while ((r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) {
        for (ssize_t i = 0; i < r; i++) CHECK(buf[i] == 0);
        n += (int)r;
    }
    return n;
}

static void pair(int sv[2]) {
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
}

/* A port of tt opened without an fd, then given a dup of sv[0]. */
static bt_port *socket_port(bt_timer_thread *tt, int sv[2]) {
    bt_port *p = NULL;
    pair(sv);
    CHECK(bt_port_open(tt, 0, &p) == 0);
    CHECK(bt_port_wake_by(p, sv[0]) == 0);
    return p;
}

/* Posts one timer to p: scheduled at `at`, fired by advancing past it. */
static void post_one(bt_timer_thread *tt, bt_port *p, int64_t at) {
    uint64_t id;
    CHECK(bt_schedule_port(tt, at, p, NULL, &id) == 0);
    CHECK(bt_advance(tt, at) >= 1);
}

static void test_one_zero_byte_per_round_of_posts(void) {
    bt_timer_thread *tt = manual_core(1000);
    int sv[2];
    pair(sv);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    CHECK(bt_port_fd(p) == -1 && !bt_port_wakes_socket(p));
    CHECK(bt_port_wake_by(p, sv[0]) == 0);
    int dup = bt_port_fd(p);
    CHECK(dup >= 0 && dup != sv[0] && bt_port_wakes_socket(p));
    CHECK((fcntl(dup, F_GETFD) & FD_CLOEXEC) != 0);
    CHECK(close(sv[0]) == 0); /* the port's own dup keeps signalling */
    post_one(tt, p, 2000);
    CHECK(take_bytes(sv[1]) == 1);
    post_one(tt, p, 3000); /* still signalled: no second byte */
    CHECK(take_bytes(sv[1]) == 0);
    bt_port_ack(p); /* reads nothing of the socket's */
    uint64_t ids[4];
    CHECK(bt_port_drain_ids(p, ids, 4) == 2);
    post_one(tt, p, 4000);
    CHECK(take_bytes(sv[1]) == 1);
    bt_port_signal(p); /* a consumer that stopped early: one more */
    CHECK(take_bytes(sv[1]) == 1);
    close(sv[1]);
    bt_destroy(tt);
}

static void test_a_post_before_the_fd_is_signalled_when_it_comes(void) {
    bt_timer_thread *tt = manual_core(1000);
    int sv[2];
    pair(sv);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    post_one(tt, p, 2000); /* signalled, with no fd to write */
    CHECK(bt_port_wake_by(p, sv[0]) == 0);
    CHECK(take_bytes(sv[1]) == 1);
    close(sv[0]);
    close(sv[1]);
    bt_destroy(tt);
}

static void test_detach_closes_the_dup_and_sends_nothing_more(void) {
    bt_timer_thread *tt = manual_core(1000);
    int sv[2];
    bt_port *p = socket_port(tt, sv);
    int dup = bt_port_fd(p);
    CHECK(bt_port_detach(p) == 0);
    CHECK(bt_port_fd(p) == -1 && bt_port_detached(p));
    CHECK(fcntl(dup, F_GETFD) == -1 && errno == EBADF);
    CHECK(fcntl(sv[0], F_GETFD) >= 0); /* the caller's socket is the caller's */
    bt_port_signal(p);
    CHECK(take_bytes(sv[1]) == 0);
    CHECK(bt_port_wake_by(p, sv[0]) == -EINVAL); /* detached */
    close(sv[0]);
    close(sv[1]);
    bt_destroy(tt);
}

static void test_a_closed_peer_is_no_sigpipe(void) {
    bt_timer_thread *tt = manual_core(1000);
    int sv[2];
    bt_port *p = socket_port(tt, sv);
    close(sv[1]); /* the loop closed: EPIPE, and no signal kills the process */
    post_one(tt, p, 2000);
    bt_port_ack(p);
    post_one(tt, p, 3000);
    close(sv[0]);
    bt_destroy(tt);
}

static void test_bad_input(void) {
    bt_timer_thread *tt = manual_core(1000);
    int sv[2];
    pair(sv);
    CHECK(bt_port_wake_by(NULL, sv[0]) == -EINVAL);
    CHECK(bt_port_wake_by(bt_orphans(tt), sv[0]) == -EINVAL);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    CHECK(bt_port_wake_by(p, 1 << 29) == -EBADF); /* no such fd */
    CHECK(bt_port_fd(p) == -1);
    CHECK(bt_port_wake_by(p, -1) == 0); /* an eventfd of its own */
    CHECK(bt_port_fd(p) >= 0 && !bt_port_wakes_socket(p));
    CHECK(bt_port_wake_by(p, sv[0]) == -EBUSY);
    CHECK(bt_port_open(tt, 1, &p) == 0);
    CHECK(bt_port_wake_by(p, -1) == -EBUSY); /* with_fd made one */
    close(sv[0]);
    close(sv[1]);
    bt_destroy(tt);
}

int main(void) {
    struct test tests[] = {
        {"one_zero_byte_per_round_of_posts", test_one_zero_byte_per_round_of_posts},
        {"a_post_before_the_fd_is_signalled_when_it_comes",
         test_a_post_before_the_fd_is_signalled_when_it_comes},
        {"detach_closes_the_dup_and_sends_nothing_more",
         test_detach_closes_the_dup_and_sends_nothing_more},
        {"a_closed_peer_is_no_sigpipe", test_a_closed_peer_is_no_sigpipe},
        {"bad_input", test_bad_input},
    };
    return RUN_TESTS(tests);
}
