/*
 * module.h -- what the files of bucketimer._core share: the module state,
 * the layouts of the objects more than one file touches, and the functions
 * one file calls in another.  Every field here is read and written with the
 * GIL held (the _Atomic ones too: they are atomic for a free-threaded
 * build's sake); the core sees a Handle only as an opaque payload.  The
 * table in docs/design.rst ("The data path") maps which file owns what.
 *
 * Names say their layer: bt_* is the core's public API (bucketimer.h),
 * bt__* the core's internals (csrc/internal.h, never used here), ext_* what
 * one file of this module calls in another; a Python type's methods are
 * Type_method, static to its file, NAME_type.c.
 */
#ifndef BT_EXT_MODULE_H
#define BT_EXT_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>

#include "bucketimer.h"
#include "compat.h"
#include "freelist.h"

static inline PyObject *ext_tuple_from_array(PyObject *const *items, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* What runs once per loop or per port, not per timer: optimised for size
 * and kept together, away from the per-timer path's cache lines. */
#define EXT_COLD __attribute__((cold))

/* ---- strong references, listed once per type ------------------------------ */

/* Each object type lists the fields that hold strong references once, as an
 * X-macro (e.g. HANDLE_REFS below); EXT_GC_TRAVERSE and EXT_GC_CLEAR write its
 * tp_traverse and tp_clear from that list, so the two cannot disagree.  A
 * new PyObject field goes in its type's list. */
#define EXT_VISIT_REF(field) Py_VISIT(self->field);
#define EXT_CLEAR_REF(field) Py_CLEAR(self->field);
#define EXT_GC_TRAVERSE(Name, Object, REFS)                                 \
    static int Name##_traverse(Object *self, visitproc visit, void *arg) { \
        Py_VISIT(Py_TYPE(self));                                           \
        REFS(EXT_VISIT_REF)                                                 \
        return 0;                                                          \
    }
#define EXT_GC_CLEAR(Name, Object, REFS) \
    static int Name##_clear(Object *self) { \
        REFS(EXT_CLEAR_REF)                  \
        return 0;                           \
    }

/* ---- fields Python can reach ----------------------------------------------- */

/* No Python code may crash the process, and Python code runs wherever C
 * calls back into it (a callback, a handler, on_error, a stand-in's method,
 * a __del__ or __eq__, a property).  So C never relies on a field that
 * Python can change without holding a reference of its own: a member or
 * getset that C reads is read-only (Py_READONLY, or a getter without a
 * setter), or checked where C reads it, and a writable one that C passes
 * across Python code (Port.on_error) is read into a new reference first.
 * Borrowed references to an object's fields live only until the next call
 * into Python.  tests/core/test_attribute_sweep.py tries every member and
 * getset of every type here. */

/* ---- module state ------------------------------------------------------- */

#define HANDLE_FREELIST 256 /* a burst of call_later+cancel pairs */
#define TIMEOUT_FREELIST 16 /* nested `async with timeout()` blocks */
#define STEP_FREELIST 2     /* __aenter__'s, then __aexit__'s */

typedef struct {
    /* types */
    PyTypeObject *TimerThread_Type, *Handle_Type, *LoopHandle_Type, *Port_Type, *Scheduler_Type;
    PyTypeObject *Timeout_Type, *Step_Type, *WaitFor_Type; /* WaitFor: 3.12+ */
    PyTypeObject *GrpcUnary_Type, *GrpcCall_Type;           /* grpc_unary_type.c */
    PyTypeObject *GrpcAioUnary_Type, *GrpcAioCoro_Type;     /* grpc_aio_type.c: 3.12+ */
    PyTypeObject *PollStamp_Type;                           /* the drop-in loop's selector */
    /* CPython's private state, read through compat.c */
    ext_compat compat;
    /* asyncio's objects that the helpers call or compare with */
    PyTypeObject *task_type;   /* asyncio.Task (the C one when present) */
    PyObject *task_cancelling; /* its cancelling() method descriptor */
    PyObject *CancelledError;
    PyObject *ExceptionGroup;
    PyObject *stock_time;      /* asyncio.BaseEventLoop.time */
    PyObject *AbstractEventLoop; /* what loop= must be an instance of */
    /* bucketimer's Python side, registered when bucketimer is imported */
    PyObject *default_class;        /* bucketimer.TimerThread */
    PyObject *wait_for_nonpositive; /* _wait_for.wait_for_nonpositive (3.12+) */
    /* what attach.c calls and compares with (_core._set_attach), and its
     * verdicts {loop class: bool} */
    PyObject *attach_class, *stamp_class, *report_to_loop, *socket_type, *BaseSelector;
    PyObject *socket_fileno; /* socket_type's fileno, unbound */
    PyObject *attach_classes;
    PyObject *selector_type; /* the last selector class found to be a BaseSelector */
    /* Python functions of the module call_later/call_at's signatures, whose
     * argument errors those raise (_core._set_signatures) */
    PyObject *sig_call_later, *sig_call_at;
    /* called with each new Handle while bucketimer.trace_timers() is on
     * (where it was armed); NULL: off, and nothing is done */
    PyObject *armed_hook;
    /* the process default TimerThread (timer_thread_type.c owns it), and a
     * cache; both written with the GIL held */
    PyObject *default_tt;
    /* loop clocks that read CLOCK_MONOTONIC besides stock_time (a list;
     * bucketimer.loop adds uvloop's) */
    PyObject *monotonic_clocks;
    /* the last loop type looked at (only compared) and its version tag,
     * which changes when its `time` is replaced (timeout_type.c, loop_clock) */
    PyTypeObject *time_checked_type;
    unsigned int time_checked_tag;
    int time_checked_kind;           /* ... and its EXT_CLOCK_* */
    /* free lists (freelist.h) and their storage */
    ext_freelist handles, timeouts, steps;
    PyObject *handle_store[HANDLE_FREELIST];
    PyObject *timeout_store[TIMEOUT_FREELIST];
    PyObject *step_store[STEP_FREELIST];
    /* interned names */
    PyObject *str_attach, *str_is_closed, *str_time, *str_call_soon, *str_call_at, *str_cancel;
    PyObject *str_cancelling;
    PyObject *str_uncancel, *str_close, *str_throw, *str_exceptions, *str_drain;
    PyObject *str_loop_closing, *str_csock, *str_ssock, *str_selector, *str_fileno,
        *str_select;
} ext_state;

/* The state's strong references (module.c's traverse and clear) and its
 * interned names with their text (created and cleared by module.c). */
#define EXT_STATE_TYPES(X) \
    X(TimerThread_Type) X(Handle_Type) X(LoopHandle_Type) X(Port_Type) X(Scheduler_Type) X(Timeout_Type) \
    X(Step_Type) X(WaitFor_Type) X(GrpcUnary_Type) X(GrpcCall_Type) X(GrpcAioUnary_Type) \
    X(GrpcAioCoro_Type) X(PollStamp_Type)
#define EXT_STATE_OBJECTS(X)                                                            \
    X(task_type) X(task_cancelling) X(CancelledError) X(ExceptionGroup) X(stock_time) \
    X(AbstractEventLoop) X(default_class) X(wait_for_nonpositive) X(default_tt) \
    X(monotonic_clocks) X(armed_hook) X(attach_class) X(stamp_class) X(report_to_loop) \
    X(socket_type) X(socket_fileno) X(BaseSelector) X(attach_classes) X(selector_type) \
    X(sig_call_later) X(sig_call_at)
#define EXT_STATE_NAMES(X)                                                                  \
    X(str_attach, "_attach") X(str_is_closed, "is_closed") X(str_time, "time")          \
    X(str_call_soon, "call_soon") X(str_call_at, "call_at")                            \
    X(str_cancel, "cancel") X(str_cancelling, "cancelling") X(str_uncancel, "uncancel") \
    X(str_close, "close") X(str_throw, "throw") X(str_exceptions, "exceptions")         \
    X(str_drain, "drain") X(str_loop_closing, "_loop_closing") X(str_csock, "_csock")     \
    X(str_ssock, "_ssock") X(str_selector, "_selector") X(str_fileno, "fileno")     \
    X(str_select, "select")

extern struct PyModuleDef ext_module_def;

/* The one way to the module state: an object keeps it in its `st` field (a
 * Handle, through its `tt`), taken when it is made, from its type (any
 * subclass's too) or, in a module function, from the module. */
static inline ext_state *ext_state_of_module(PyObject *module) {
    return (ext_state *)PyModule_GetState(module);
}

static inline ext_state *ext_state_of_type(PyTypeObject *tp) {
    PyObject *m = PyType_GetModuleByDef(tp, &ext_module_def);
    return m ? ext_state_of_module(m) : NULL;
}

/* In a dealloc: the state of the module that made `tp` (exactly), or NULL
 * when that module is going.  At interpreter exit the last collection may
 * clear a type's module reference and free the module, whose state holds
 * the free lists, while instances of the type are still to be freed; a
 * type holds its module (ht_module, a strong reference) until then, and
 * never sets an error here. */
static inline ext_state *ext_state_alive(PyTypeObject *tp) {
    PyObject *m = ((PyHeapTypeObject *)tp)->ht_module;
    return m ? ext_state_of_module(m) : NULL;
}

/* ---- objects ------------------------------------------------------------ */

enum handle_state { H_PENDING = 0, H_CANCELLED = 1, H_RAN = 2, H_DROPPED = 3 };

typedef struct TimerThreadObject TimerThreadObject;
typedef struct HandleObject HandleObject;

/* A selector's select(), noting when each poll returned, and after each
 * poll delivering what is due to the ports it watches (poll_stamp_type.c). */
typedef struct {
    PyObject_HEAD
    PyObject *selector;
    PyObject *select;    /* selector.select, bound when made */
    PyObject *ports;     /* list of the Ports of this selector's loop */
    long long polled_ns; /* the last select()'s return, or the first _watch; else -1 */
} PollStampObject;
#define POLLSTAMP_REFS(X) X(selector) X(select) X(ports)

typedef struct {
    PyObject_HEAD
    bt_port *port;
    TimerThreadObject *tt; /* strong: keeps the core alive */
    PyObject *loop;        /* the loop it serves, or None (dispatcher) */
    PyObject *on_error;    /* on_error(handle, exc), or None */
    int drop;              /* drain releases without running (orphans) */
    int released;          /* detached and its timers cancelled (ext_port_release) */
    _Atomic int draining;
    /* on_slow(callback, args, seconds, slow_after): called after a callback that ran
     * slow_after seconds or longer (None: callbacks are not timed). */
    PyObject *on_slow;
    double slow_after;
    /* the loop's PollStamp, or NULL: drain() runs what was due by its last
     * poll (docs/design.rst, "Order on the loop") */
    PollStampObject *stamp;
    /* the core's next schedule order at that poll (bt_port_next_seq): what
     * was scheduled since waits for the next iteration, as asyncio's heap
     * keeps it; UINT64_MAX before the first */
    uint64_t polled_seq;
    /* what the stamp adds to a poll's events to queue drain() when the port
     * wakes its loop through the loop's self-pipe (bt_port_wake_by): made by
     * the stamp's _wake_event the first time, or NULL */
    PyObject *wake_event;
    long wake_peer; /* the fd of the loop's reader of that self-pipe, or -1 */
    /* The Handles whose timers the core holds for this port: the slot's
     * reference to each is the port's to the cyclic GC (its traverse visits
     * them, its clear cancels them), so a loop and its pending timers are
     * collected together, as asyncio's loop and its heap are (handle_type.c,
     * ext_handle_hold). */
    HandleObject *held;
    PyObject *weakreflist;
} PortObject;
/* What a GC clear takes; tt only goes with the port (port_type.c, Port_clear). */
#define PORT_CLEARED_REFS(X) X(loop) X(on_error) X(on_slow) X(stamp) X(wake_event)
#define PORT_REFS(X) PORT_CLEARED_REFS(X) X(tt)

struct HandleObject {
    PyObject_HEAD
    TimerThreadObject *tt; /* strong */
    PortObject *port;      /* strong */
    uint64_t id;
    double when;
    PyObject *when_obj;    /* what call_at was given, which when() returns; or NULL */
    PyObject *callback;    /* NULL once finished */
    PyObject *args;
    PyObject *context;
    _Atomic int state;
    /* A LoopHandle's cancel() was called (its cancelled(), as
     * asyncio.TimerHandle's, is True from then on, even if it had run). */
    unsigned char cancel_called;
    /* the callback is a Timeout whose expiry this runs (no bound method) */
    unsigned char is_timeout;
    /* in its port's `held` list: the core's slot holds a reference */
    unsigned char held;
    HandleObject *held_prev, *held_next;
    PyObject *weakreflist;
};
#define HANDLE_REFS(X) X(tt) X(port) X(when_obj) X(callback) X(args) X(context)
/* What Handle_clear clears: tt and port stay while the core holds the
 * Handle (its port's clear releases it; handle_type.c). */
#define HANDLE_CALLBACK_REFS(X) X(when_obj) X(callback) X(args) X(context)

struct TimerThreadObject {
    PyObject_HEAD
    bt_timer_thread *core;
    ext_state *st;
    /* Where timers go (timer_thread_type.c, ext_port_for, owns all three):
     * the port of each loop served, as {id(loop): weakref(Port)} (a Port is
     * held by its loop's reader and its pending Handles, never by this
     * record, so that an unreferenced loop is collected: docs/design.rst,
     * "Lifetimes"); the dispatcher's (loop None); and the last port looked
     * up, borrowed (a Port forgets itself here when it goes), so a loop's
     * timers skip the dict.  The cache is only used with the GIL. */
    PyObject *ports;
    PortObject *dispatcher; /* NULL until first needed */
    PortObject *cached_port;
    int closed;
    /* A close() whose join failed: the core is stopped (nothing runs, nothing
     * can be scheduled) but its thread lives and its timers are kept; the
     * next close() tries again (timer_thread_type.c, close_core). */
    int stop_failed;
    /* set by _timers once its dispatcher audits the loops, cleared as it
     * stops or closes: a loop's port may be connected in C (attach.c) */
    int fast_attach;
    PyObject *weakreflist;
};
#define TIMERTHREAD_REFS(X) X(ports) X(dispatcher)


enum { T_CREATED, T_ENTERED, T_EXPIRING, T_EXPIRED, T_EXITED };

typedef struct TimeoutObject {
    PyObject_HEAD
    ext_state *st;
    int state;
    long cancelling;
    PyObject *when;     /* a number, or None */
    PyObject *handler;  /* our Handle, or the loop's call_soon handle */
    PyObject *task;
    PyObject *on_timeout; /* bound _on_timeout, made on first arming */
    PyObject *step;       /* the Step __aenter__ returned, kept to serve __aexit__ */
    PyObject *weakreflist;
} TimeoutObject;
#define TIMEOUT_REFS(X) X(when) X(handler) X(task) X(on_timeout) X(step)


/* ---- types (their specs, added to the module by module.c) --------------- */

extern PyType_Spec Handle_spec, LoopHandle_spec, Port_spec, TimerThread_spec, Scheduler_spec, Step_spec,
    Timeout_spec, WaitFor_spec, GrpcUnary_spec, GrpcCall_spec, GrpcAioUnary_spec, GrpcAioCoro_spec,
    PollStamp_spec;

/* ---- across files ------------------------------------------------------- */

/* schedule.c */
PyObject *ext_raise_errno(int rc, const char *what);
/* TypeError("<what> must be <be>, not <type(o).__name__>"), the message
 * the pure backend writes with an f-string; returns -1. */
int ext_type_error(const char *what, const char *be, PyObject *o);
/* A delay or deadline as seconds: TypeError for what is not a real number
 * (bool, str, None...), ValueError for NaN; beyond the double range, +-inf. */
int ext_to_seconds(PyObject *o, const char *what, double *out);
/* (time, callback, *args) and the keywords context= and, where `loop` is
 * not NULL, loop=. */
int ext_parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        int absolute, PyObject **loop, PyObject **context);
#define EXT_SCHED_COMPAT 1  /* a LoopHandle: asyncio.TimerHandle's semantics */
#define EXT_SCHED_TIMEOUT 2 /* cb is a Timeout: expire it */
/* The one argument of a function taking `name` by position or keyword
 * (asyncio's timeout(delay), timeout_at(when), reschedule(when)). */
int ext_one_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *func,
                const char *name, PyObject **out);
/* The common tail of every way to schedule: `t` is a parsed delay or
 * deadline (`absolute`), `loop` the loop it goes to (None: the dispatcher).
 * A new Handle, or NULL. */
PyObject *ext_schedule(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                            PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                            PyObject *context, int flags);

/* timer_thread_type.c */
int ext_check_open(TimerThreadObject *self);
/* A Port going away (collected, or released): the record and the cache
 * forget it. */
void ext_forget_port(TimerThreadObject *self, PortObject *port);
/* The port of `loop` (None: the dispatcher), a new reference. */
PortObject *ext_port_for(TimerThreadObject *self, PyObject *loop);
/* The object a weak reference names (a new reference), or NULL once dead. */
PyObject *ext_weak_target(PyObject *ref);
/* attach.c: connects a new port to the running loop `loop` in C: 1 done,
 * 0 not a case for it (nothing changed: _attach's), -1 with an exception. */
int ext_attach_fast(TimerThreadObject *self, PyObject *loop, PortObject *port);
/* attach.c: 1 if `loop` is this thread's running loop (or the loop being
 * made, ext_port_of_made) and of a class vetted for ext_attach_fast (an
 * asyncio selector loop, open while it runs), 0 if not, -1 with an
 * exception. */
int ext_loop_inside(ext_state *st, PyObject *loop);
/* attach.c: the port of `loop`, a loop that its constructor is making in
 * this thread: no other thread can have it yet and it is open, so it is
 * connected as the running loop's would be (a new reference). */
PortObject *ext_port_of_made(TimerThreadObject *self, PyObject *loop);
/* attach.c: _core._made_loop(), the loop ext_port_of_made is connecting in
 * this thread, or None: what _timers.TimerThread._attach asks. */
PyObject *ext_made_loop(PyObject *m, PyObject *ignored);
PyObject *ext_set_attach(PyObject *m, PyObject *args);
/* _core.call_later / call_at: the default TimerThread's. */
PyObject *ext_module_call_later(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);
PyObject *ext_module_call_at(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *ext_set_signatures(PyObject *m, PyObject *args);
/* loop_attrs.c: _core._loop_setattr and _loop_delattr, the drop-in loop's. */
int ext_add_loop_attrs(PyObject *m);
/* poll_stamp_type.c: a PollStamp (of `type`, a subclass whose __init__ is
 * object's) wrapping `selector`, as type(selector) makes one. */
PyObject *ext_poll_stamp_new(ext_state *st, PyTypeObject *type, PyObject *selector);
/* poll_stamp_type.c: the stamp's poll watches `port` (PollStamp._watch). */
int ext_poll_stamp_watch(PollStampObject *self, PortObject *port);
/* The process default TimerThread (borrowed), made anew once closed. */
TimerThreadObject *ext_default_tt(ext_state *st);
/* A Handle just scheduled, while st->armed_hook is set: the hook is told
 * (where it was armed); its errors are unraisable, never the caller's. */
void ext_note_armed(ext_state *st, PyObject *h);
/* Before a callback is queued on `loop` with call_soon: the default
 * TimerThread's timers due for that loop go first (docs/design.rst, "Order
 * on the loop").  0, or -1 with an exception. */
int ext_deliver_due(ext_state *st, PyObject *loop);

/* handle_type.c */
/* A Handle for cb(*args) delivered through `port` (a reference it takes
 * over), in `context` (NULL: a copy of the current one; a Timeout's expiry
 * needs none). */
HandleObject *ext_handle_new(TimerThreadObject *tt, PortObject *port, double when, PyObject *cb,
                         PyObject *const *args, Py_ssize_t nargs, PyObject *context, int flags);
/* call_at's `when` argument, kept for when() as asyncio's TimerHandle keeps
 * it: on a LoopHandle whatever it was, on a Handle an int. */
void ext_handle_keep_when(PyObject *h, PyObject *when);
/* A LoopHandle given a NaN time: when() is NaN, as asyncio's would be. */
void ext_handle_when_nan(PyObject *h);
/* A Handle the core refused: both its references dropped. */
void ext_handle_abandon(HandleObject *h);
void ext_handle_release_callback(HandleObject *self);
/* The core's slot took a reference to h (bt_schedule_port succeeded): h
 * goes on its port's held list.  ext_handle_unhold: the slot's reference
 * leaves the core (a cancel won, a drain claimed it, a drop). */
void ext_handle_hold(HandleObject *h);
void ext_handle_unhold(HandleObject *h);
int ext_handle_cancel(HandleObject *self);
void ext_drop_handle(void *ctx, bt_port *port, void *payload);
/* Runs (drop: releases unrun) a handle its port's drain claimed, its
 * callback in its context; an exception goes to on_error(handle, exc) or
 * sys.unraisablehook.  -1 with an exception only for what must propagate
 * (KeyboardInterrupt, SystemExit, a failing on_error). */
int ext_handle_run(HandleObject *h, PyObject *on_error, int drop);
/* Moves a pending handle's timer to the later deadline `when` (seconds):
 * 1 if the core moved it, 0 if not (it is no longer pending, or earlier). */
int ext_handle_postpone(HandleObject *h, double when);

/* port_type.c */
PortObject *ext_port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop);
/* Detaches the port and cancels every timer still bound to it: a port whose
 * loop is gone, or that was refused.  -1 with an exception. */
int ext_port_release(PortObject *self);
/* bt_port_deliver_due at `now` with the GIL held: it lets the GIL go only to
 * wait for another thread's pass.  1 if it ran a pass, 0 if none could be
 * due or the core refuses (stopped, forked, one of its own callbacks). */
int ext_port_deliver_due(PortObject *self, int64_t now);
/* The bound drain() takes by default: the port's loop's last poll (ns), or
 * -1 (all), and in *seq the core's next schedule order then. */
int64_t ext_port_drain_bound(PortObject *self, uint64_t *seq);


/* scheduler_type.c */
PyObject *ext_TimerThread_scheduler(TimerThreadObject *self, PyObject *args);
PyObject *ext_default_scheduler(PyObject *m, PyObject *args);

/* timeout_type.c */
PyObject *ext_throw_args_exception(PyObject *const *args, Py_ssize_t nargs);
/* What a loop's clock is: its own (a virtual clock: the loop's own timers
 * follow it), CLOCK_MONOTONIC through loop.time(), or asyncio's
 * BaseEventLoop.time, which the core reads itself.  -1 with an error. */
enum { EXT_CLOCK_FOREIGN = 0, EXT_CLOCK_MONOTONIC = 1, EXT_CLOCK_STOCK = 2 };
int ext_loop_clock(ext_state *st, PyObject *loop);
PyObject *ext_loop_clock_is_foreign(PyObject *m, PyObject *loop);
PyObject *ext_add_monotonic_clock(PyObject *m, PyObject *time);
PyObject *ext_need_running_loop(ext_state *st);
PyObject *ext_timeout_on_loop(ext_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns);
int ext_timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns);
int ext_timeout_exit(TimeoutObject *self, PyObject *exc_type, PyObject *exc_val);
PyObject *ext_timeout_fire(PyObject *timeout);
PyObject *ext_timeout(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ext_timeout_at(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames);

/* wait_for_type.c (3.12 and later) */
PyObject *ext_wait_for(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ext_set_wait_for_nonpositive(PyObject *m, PyObject *fn);
/* The C coroutine shell (3.12 and later): a C coroutine object starts with
 * an ext_coro, whose kind says how it starts and resumes; the shell keeps the
 * generator protocol's rules (no re-entry, no reuse after the end, throw()
 * and close() before the start) and gives its type the slots and methods
 * below (tp_iternext, am_await, am_send, tp_finalize, tp_methods, tp_getset). */
enum { EXT_CORO_CREATED, EXT_CORO_SUSPENDED, EXT_CORO_CLOSED };
typedef struct ext_coro_kind ext_coro_kind;
typedef struct {
    PyObject_HEAD
    const ext_coro_kind *kind;
    ext_state *st;
    int state;   /* EXT_CORO_*: the kind's start and resume set it */
    int running; /* inside send/throw/close */
} ext_coro;
struct ext_coro_kind {
    const char *name; /* __name__, and the "never awaited" warning's */
    /* the first send(None): the body up to its first suspension */
    PySendResult (*start)(ext_coro *self, PyObject **result);
    /* a later send(arg) (exc NULL) or throw(exc) */
    PySendResult (*resume)(ext_coro *self, PyObject *arg, PyObject *exc, PyObject **result);
    /* closed or thrown into before it started: drop what start would have used */
    void (*discard)(ext_coro *self);
    /* what it awaits while suspended (borrowed; NULL: nothing) */
    PyObject *(*awaiting)(ext_coro *self);
};
PySendResult ext_coro_step(ext_coro *self, PyObject *arg, PyObject *exc, PyObject **result);
PySendResult ext_coro_am_send(PyObject *self, PyObject *arg, PyObject **result);
PyObject *ext_coro_iternext(PyObject *self);
PyObject *ext_coro_self_await(PyObject *self);
void ext_coro_finalize(PyObject *self);
extern PyMethodDef ext_coro_methods[];
extern PyGetSetDef ext_coro_getset[];
/* The slots a C coroutine type takes from the shell. */
#define EXT_CORO_SLOTS                                                                    \
    {Py_tp_finalize, ext_coro_finalize}, {Py_tp_iter, PyObject_SelfIter},                 \
        {Py_tp_iternext, ext_coro_iternext}, {Py_am_await, ext_coro_self_await},          \
        {Py_am_send, ext_coro_am_send}, {Py_tp_methods, ext_coro_methods},                \
        {Py_tp_getset, ext_coro_getset}
/* The coroutine protocol's pieces that grpc_aio_type.c shares: what `await o`
 * iterates (GET_AWAITABLE); raising `exc` (stolen) with __context__ `context`
 * (stolen) as inside an `except` block; the value of the StopIteration that
 * ends a call; close() of an iterator that has one; throw(exc) into an
 * awaited iterator as `yield from` does; a step's outcome as a call's. */
PyObject *ext_awaitable_iter(ext_state *st, PyObject *o);
void ext_raise_with_context(PyObject *exc, PyObject *context);
PySendResult ext_fetch_return(PyObject **result);
int ext_close_iter(ext_state *st, PyObject *it);
PySendResult ext_throw_into(ext_state *st, PyObject *inner, PyObject *exc, PyObject **result);
PyObject *ext_step_as_call(ext_state *st, PySendResult r, PyObject *result);

#endif
