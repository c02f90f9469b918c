/*
 * _core.c -- the CPython face of the native core.
 *
 * Types (heap types, one module state, multi-phase init):
 *   TimerThread  owns one bt_timer_thread.  call_later / call_at are the hot
 *                path: parse, capture the context, pick the port, schedule.
 *   Handle       one scheduled callback.  While PENDING or POSTED the core's
 *                slot owns a strong reference to it (taken at schedule).  The
 *                thread that moves it to a terminal state drops that
 *                reference, always with the GIL (or, free-threaded, as the
 *                only winner of the CAS): cancel() when it wins, the port's
 *                consumer after running it, close() for dropped timers.
 *   Port         a bt_port: where due timers of one event loop (or of the
 *                dispatcher thread) wait.  drain() runs them.
 *
 * The timer thread itself never takes the GIL: it sees Handles only as
 * opaque payload pointers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>

#include "bucketimer.h"

/* ---- compatibility: 3.11 lacks a few 3.12 spellings ------------------- */

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
static PyObject *PyErr_GetRaisedException(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb) PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}
static void PyErr_SetRaisedException(PyObject *exc) {
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#endif

static PyObject *tuple_from_array(PyObject *const *items, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* ---- module state ------------------------------------------------------- */

typedef struct {
    PyTypeObject *TimerThread_Type;
    PyTypeObject *Handle_Type;
    PyTypeObject *Port_Type;
    PyObject *get_running_loop; /* asyncio's C _get_running_loop */
    PyObject *str_port_for;     /* "_port_for" */
#if PY_VERSION_HEX < 0x030C0000
    PyObject *str_running_loop_key;
    PyTypeObject *holder_type;  /* _asyncio._RunningLoopHolder, once seen */
#endif
} core_state;

static inline core_state *get_state(PyObject *module) {
    return (core_state *)PyModule_GetState(module);
}

/* ---- objects ------------------------------------------------------------ */

enum handle_state { H_PENDING = 0, H_CANCELLED = 1, H_RAN = 2, H_DROPPED = 3 };

typedef struct TimerThreadObject TimerThreadObject;

typedef struct {
    PyObject_HEAD
    bt_port *port;
    TimerThreadObject *tt; /* strong: keeps the core alive */
    PyObject *loop;        /* the loop it serves, or None (dispatcher) */
    PyObject *on_error;    /* on_error(handle, exc), or None */
    int drop;              /* drain releases without running (orphans) */
    _Atomic int draining;
    PyObject *weakreflist;
} PortObject;

typedef struct {
    PyObject_HEAD
    TimerThreadObject *tt; /* strong */
    PortObject *port;      /* strong */
    uint64_t id;
    double when;
    PyObject *callback;    /* NULL once finished */
    PyObject *args;
    PyObject *context;
    _Atomic int state;
    PyObject *weakreflist;
} HandleObject;

struct TimerThreadObject {
    PyObject_HEAD
    bt_timer_thread *core;
    core_state *state;
    /* Last (loop -> port) resolved, so a loop's timers skip the dict.
     * Only used with the GIL: free-threaded builds always call _port_for. */
    PyObject *cached_loop;
    PortObject *cached_port;
    PortObject *dispatcher; /* the port of loop None, once created */
    int closed;
    PyObject *weakreflist;
};

static PyObject *raise_errno(int rc, const char *what) {
    if (rc == -ENOMEM) return PyErr_NoMemory();
    if (rc == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is closed");
        return NULL;
    }
    if (rc == -ECHILD) {
        PyErr_SetString(PyExc_RuntimeError,
                        "TimerThread was created in a parent process; its thread does not "
                        "exist after fork()");
        return NULL;
    }
    errno = -rc;
    PyErr_Format(PyExc_OSError, "%s failed: %s", what, strerror(-rc));
    return NULL;
}

/* ---- the running loop ----------------------------------------------------
 * asyncio's C _get_running_loop on 3.11 calls getpid() on every call (a
 * syscall since glibc stopped caching it) to hide a parent's loop from a
 * forked child.  That is a third of a schedule+cancel pair.  On 3.11 we read
 * the same per-thread holder asyncio reads and compare its pid with one we
 * cache and refresh after fork().  3.12 dropped the pid check, so there we
 * call asyncio's function. */

#if PY_VERSION_HEX < 0x030C0000
#include <unistd.h>
typedef struct {
    PyObject_HEAD
    PyObject *rl_loop;
    pid_t rl_pid;
} running_loop_holder; /* _asynciomodule.c, 3.11 */

static _Atomic pid_t cached_pid;
static void refresh_pid(void) { atomic_store(&cached_pid, getpid()); }
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;
static void install_pid_cache(void) {
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}
#endif

/* New reference to the running loop of this thread, or to None. */
static PyObject *running_loop(core_state *st) {
#if PY_VERSION_HEX < 0x030C0000
    PyObject *d = PyThreadState_GetDict();
    if (d) {
        PyObject *holder = PyDict_GetItemWithError(d, st->str_running_loop_key);
        if (!holder) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (!st->holder_type &&
            strstr(Py_TYPE(holder)->tp_name, "_RunningLoopHolder") != NULL &&
            Py_TYPE(holder)->tp_basicsize == sizeof(running_loop_holder))
            st->holder_type = (PyTypeObject *)Py_NewRef(Py_TYPE(holder));
        if (Py_TYPE(holder) == st->holder_type) {
            running_loop_holder *h = (running_loop_holder *)holder;
            if (h->rl_pid != atomic_load_explicit(&cached_pid, memory_order_relaxed))
                Py_RETURN_NONE;
            return Py_NewRef(h->rl_loop);
        }
    }
#endif
    return PyObject_CallNoArgs(st->get_running_loop);
}

/* ---- time parsing ------------------------------------------------------- */

/* Converts a delay or deadline to a double; TypeError for non-numbers (str,
 * bytes, None, bool), ValueError for NaN. */
static int to_seconds(PyObject *o, const char *what, double *out) {
    double v;
    if (PyFloat_CheckExact(o)) {
        v = PyFloat_AS_DOUBLE(o);
    } else if (PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not bool", what);
        return -1;
    } else if (PyLong_Check(o) || PyFloat_Check(o) ||
               (Py_TYPE(o)->tp_as_number && (Py_TYPE(o)->tp_as_number->nb_float ||
                                             Py_TYPE(o)->tp_as_number->nb_index))) {
        v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                /* an int too large for a double: as good as forever */
                PyErr_Clear();
                v = INFINITY;
                if (PyLong_Check(o)) {
                    PyObject *zero = PyLong_FromLong(0);
                    if (!zero) return -1;
                    int neg = PyObject_RichCompareBool(o, zero, Py_LT);
                    Py_DECREF(zero);
                    if (neg < 0) return -1;
                    if (neg) v = -INFINITY;
                }
            } else {
                return -1;
            }
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    if (isnan(v)) {
        PyErr_Format(PyExc_ValueError, "%s must not be NaN", what);
        return -1;
    }
    *out = v;
    return 0;
}

/* Seconds on the monotonic clock -> ns, rounded up so that a timer never
 * fires before time.monotonic() reaches `when`.  +inf and anything past the
 * int64 range means never (INT64_MAX); -inf means as soon as possible. */
static int64_t when_to_ns(double when) {
    if (when >= 9.2e9) return INT64_MAX;
    if (when <= -9.2e9) return INT64_MIN / 2;
    return (int64_t)ceil(when * 1e9);
}

/* ---- Handle ------------------------------------------------------------- */

static int Handle_traverse(HandleObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tt);
    Py_VISIT(self->port);
    Py_VISIT(self->callback);
    Py_VISIT(self->args);
    Py_VISIT(self->context);
    return 0;
}

static int Handle_clear(HandleObject *self) {
    Py_CLEAR(self->tt);
    Py_CLEAR(self->port);
    Py_CLEAR(self->callback);
    Py_CLEAR(self->args);
    Py_CLEAR(self->context);
    return 0;
}

/* A small free list of Handle objects: a schedule+cancel pair then costs no
 * allocation and no step towards a GC collection.  Only with the GIL, which
 * serialises it; free-threaded builds allocate every time. */
#ifndef Py_GIL_DISABLED
#define HANDLE_FREELIST_MAX 256
static HandleObject *handle_freelist[HANDLE_FREELIST_MAX];
static int handle_freelist_len;
#endif

static void Handle_dealloc(HandleObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    Handle_clear(self);
#ifndef Py_GIL_DISABLED
    if (handle_freelist_len < HANDLE_FREELIST_MAX && Py_IS_TYPE(self, tp) &&
        !(tp->tp_flags & Py_TPFLAGS_BASETYPE)) {
        handle_freelist[handle_freelist_len++] = self;
        Py_DECREF(tp); /* PyObject_Init takes it again on reuse */
        return;
    }
#endif
    tp->tp_free(self);
    Py_DECREF(tp);
}

static HandleObject *handle_alloc(PyTypeObject *tp) {
#ifndef Py_GIL_DISABLED
    if (handle_freelist_len > 0) {
        HandleObject *h = handle_freelist[--handle_freelist_len];
        if (Py_TYPE(h) == tp) {
            (void)PyObject_Init((PyObject *)h, tp);
            return h;
        }
        /* another interpreter's (or a reloaded module's) type: let it go */
        PyObject_GC_Del(h);
    }
#endif
    return PyObject_GC_New(HandleObject, tp);
}

/* Drops what a finished handle no longer needs (the tt and port stay, so
 * cancel() after the fact still has something to ask). */
static void handle_release_callback(HandleObject *self) {
    PyObject *cb = self->callback, *args = self->args, *ctx = self->context;
    self->callback = self->args = self->context = NULL;
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
}

static PyObject *Handle_cancel(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (atomic_load_explicit(&self->state, memory_order_acquire) != H_PENDING || !self->tt)
        Py_RETURN_FALSE;
    int rc = bt_cancel(self->tt->core, self->id);
    if (rc != BT_CANCELLED) Py_RETURN_FALSE;
    /* We won the core's CAS: nobody else will touch the callback, and the
     * slot's reference to us is ours to drop. */
    atomic_store_explicit(&self->state, H_CANCELLED, memory_order_release);
    handle_release_callback(self);
    Py_DECREF(self); /* the slot's reference; the caller still holds one */
    Py_RETURN_TRUE;
}

static PyObject *Handle_cancelled(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(atomic_load(&self->state) == H_CANCELLED);
}

static PyObject *Handle_when(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble(self->when);
}

static PyObject *Handle_get_context(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->context) Py_RETURN_NONE;
    return Py_NewRef(self->context);
}

static PyObject *Handle_get_id(HandleObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *Handle_get_loop(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->port) Py_RETURN_NONE;
    return Py_NewRef(self->port->loop);
}

static PyObject *Handle_get_callback(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->callback) Py_RETURN_NONE;
    return Py_NewRef(self->callback);
}

static PyObject *Handle_get_args(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->args) Py_RETURN_NONE;
    return Py_NewRef(self->args);
}

static PyObject *Handle_repr(HandleObject *self) {
    static const char *names[] = {"pending", "cancelled", "ran", "dropped"};
    int st = atomic_load(&self->state);
    if (self->callback) {
        PyObject *when = PyFloat_FromDouble(self->when);
        if (!when) return NULL;
        PyObject *r = PyUnicode_FromFormat("<bucketimer.Handle %s when=%R %R>", names[st], when,
                                           self->callback);
        Py_DECREF(when);
        return r;
    }
    return PyUnicode_FromFormat("<bucketimer.Handle %s id=%llu>", names[st],
                                (unsigned long long)self->id);
}

static PyMethodDef Handle_methods[] = {
    {"cancel", (PyCFunction)Handle_cancel, METH_NOARGS,
     "cancel() -> bool\n\nTrue iff this call guaranteed the callback never runs. False if it "
     "is running, has run, was cancelled or dropped before, or its TimerThread is closed."},
    {"cancelled", (PyCFunction)Handle_cancelled, METH_NOARGS,
     "True iff a cancel() of this handle won."},
    {"when", (PyCFunction)Handle_when, METH_NOARGS,
     "The deadline, in time.monotonic() seconds."},
    {"get_context", (PyCFunction)Handle_get_context, METH_NOARGS,
     "The contextvars.Context the callback runs in (None once finished)."},
    {NULL}};

static PyGetSetDef Handle_getset[] = {
    {"id", (getter)Handle_get_id, NULL, "The core's versioned timer id.", NULL},
    {"loop", (getter)Handle_get_loop, NULL, "The loop it is delivered to (None: dispatcher).",
     NULL},
    {"callback", (getter)Handle_get_callback, NULL, "The callback (None once finished).", NULL},
    {"args", (getter)Handle_get_args, NULL, "The callback's arguments (None once finished).",
     NULL},
    {NULL}};

static PyMemberDef Handle_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(HandleObject, weakreflist), Py_READONLY},
    {NULL}};

static PyType_Slot Handle_slots[] = {
    {Py_tp_doc, "A scheduled callback.  Made by TimerThread.call_later / call_at."},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_methods, Handle_methods},
    {Py_tp_getset, Handle_getset},
    {Py_tp_members, Handle_members},
    {Py_tp_repr, Handle_repr},
    {0, NULL}};

static PyType_Spec Handle_spec = {
    .name = "bucketimer._core.Handle",
    .basicsize = sizeof(HandleObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Handle_slots,
};

/* ---- Port --------------------------------------------------------------- */

static int Port_traverse(PortObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tt);
    Py_VISIT(self->loop);
    Py_VISIT(self->on_error);
    return 0;
}

static int Port_clear(PortObject *self) {
    Py_CLEAR(self->loop);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->tt);
    return 0;
}

static void Port_dealloc(PortObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    /* The bt_port itself lives until the core is destroyed: pending timers
     * may still point at it. */
    Port_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Runs (or, in drop mode, releases) one claimed handle.  Returns -1 with an
 * exception set only for exceptions that must propagate (KeyboardInterrupt,
 * SystemExit, or a failing error handler). */
static int run_handle(PortObject *self, HandleObject *h, int drop) {
    PyObject *cb = h->callback, *args = h->args, *ctx = h->context;
    h->callback = h->args = h->context = NULL;
    atomic_store_explicit(&h->state, drop ? H_DROPPED : H_RAN, memory_order_release);
    int result = 0;
    if (!drop && cb) {
        PyObject *res = NULL;
        if (PyContext_Enter(ctx) == 0) {
            res = PyObject_Call(cb, args, NULL);
            PyObject *exc = res ? NULL : PyErr_GetRaisedException();
            PyContext_Exit(ctx);
            if (exc) PyErr_SetRaisedException(exc);
        }
        if (res) {
            Py_DECREF(res);
        } else if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
                   PyErr_ExceptionMatches(PyExc_SystemExit)) {
            result = -1;
        } else {
            PyObject *exc = PyErr_GetRaisedException();
            /* The handle shows its callback while being reported. */
            h->callback = Py_NewRef(cb);
            h->args = Py_NewRef(args);
            if (self->on_error && self->on_error != Py_None) {
                PyObject *r = PyObject_CallFunctionObjArgs(self->on_error, (PyObject *)h, exc,
                                                           NULL);
                if (r) Py_DECREF(r);
                else if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
                         PyErr_ExceptionMatches(PyExc_SystemExit))
                    result = -1;
                else PyErr_WriteUnraisable(self->on_error);
            } else {
                PyErr_SetRaisedException(Py_NewRef(exc));
                PyErr_WriteUnraisable(cb);
            }
            Py_DECREF(exc);
            Py_CLEAR(h->callback);
            Py_CLEAR(h->args);
        }
    }
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
    return result;
}

/* Runs every timer posted to this port.  The eventfd is acked first; a
 * timer cancelled after it was posted is released without running (its
 * cancel() already dropped the slot's reference).  If a callback raises
 * KeyboardInterrupt or SystemExit, the rest stay queued, the port is
 * signalled again, and the exception propagates, as asyncio would let it. */
static PyObject *Port_drain_impl(PortObject *self, int drop_all) {
    if (atomic_exchange(&self->draining, 1)) return PyLong_FromLong(0); /* re-entered */
    int drop = drop_all || self->drop;
    bt_port_ack(self->port);
    long ran = 0;
    bt_timer *t;
    while ((t = bt_port_pop(self->port)) != NULL) {
        HandleObject *h = (HandleObject *)bt_timer_payload(t);
        if (!(drop ? bt_timer_take(self->port, t) : bt_timer_claim(self->port, t))) {
            bt_timer_release(self->port, t);
            continue;
        }
        /* The slot's reference to h is ours now. */
        bt_timer_release(self->port, t);
        int rc = run_handle(self, h, drop);
        Py_DECREF(h);
        ran++;
        if (rc < 0) {
            bt_port_signal(self->port);
            atomic_store(&self->draining, 0);
            return NULL;
        }
    }
    atomic_store(&self->draining, 0);
    return PyLong_FromLong(ran);
}

static PyObject *Port_drain(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    return Port_drain_impl(self, 0);
}

static PyObject *Port_fileno(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(bt_port_fd(self->port));
}

/* Closes the fd and releases whatever is queued without running it.  Timers
 * that come due later go to the core's orphan port. */
static PyObject *Port_detach(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    bt_port_detach(self->port);
    PyObject *r = Port_drain_impl(self, 1);
    if (!r) return NULL;
    Py_DECREF(r);
    TimerThreadObject *tt = self->tt;
    if (tt && tt->cached_port == self) {
        Py_CLEAR(tt->cached_loop);
        Py_CLEAR(tt->cached_port);
    }
    Py_RETURN_NONE;
}

static PyObject *Port_get_loop(PortObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->loop);
}

static PyMethodDef Port_methods[] = {
    {"drain", (PyCFunction)Port_drain, METH_NOARGS,
     "Run every posted timer; returns how many were taken."},
    {"fileno", (PyCFunction)Port_fileno, METH_NOARGS,
     "The eventfd that becomes readable when timers are posted (-1 when detached)."},
    {"detach", (PyCFunction)Port_detach, METH_NOARGS,
     "Close the fd and drop queued timers without running them."},
    {NULL}};

static PyGetSetDef Port_getset[] = {
    {"loop", (getter)Port_get_loop, NULL, "The loop served (None: dispatcher).", NULL},
    {NULL}};

static PyMemberDef Port_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(PortObject, weakreflist), Py_READONLY},
    {"on_error", Py_T_OBJECT_EX, offsetof(PortObject, on_error), 0,
     "on_error(handle, exc): called when a callback raises."},
    {NULL}};

static PyType_Slot Port_slots[] = {
    {Py_tp_doc, "Where due timers of one loop (or the dispatcher) wait to run."},
    {Py_tp_dealloc, Port_dealloc},
    {Py_tp_traverse, Port_traverse},
    {Py_tp_clear, Port_clear},
    {Py_tp_methods, Port_methods},
    {Py_tp_getset, Port_getset},
    {Py_tp_members, Port_members},
    {0, NULL}};

static PyType_Spec Port_spec = {
    .name = "bucketimer._core.Port",
    .basicsize = sizeof(PortObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Port_slots,
};

static PortObject *port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop) {
    PortObject *self = PyObject_GC_New(PortObject, tt->state->Port_Type);
    if (!self) return NULL;
    self->port = p;
    self->tt = (TimerThreadObject *)Py_NewRef(tt);
    self->loop = Py_NewRef(loop);
    self->on_error = Py_NewRef(Py_None);
    self->drop = drop;
    atomic_init(&self->draining, 0);
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return self;
}

/* ---- TimerThread -------------------------------------------------------- */

static struct PyModuleDef core_module;

static int TimerThread_init(TimerThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buckets", "drain_threshold", NULL};
    unsigned int buckets = 13, drain = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I$I:TimerThread", kwlist, &buckets, &drain))
        return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is already initialised");
        return -1;
    }
    if (buckets < 1 || buckets > 256) {
        PyErr_SetString(PyExc_ValueError, "buckets must be between 1 and 256");
        return -1;
    }
    if (drain < 16) {
        PyErr_SetString(PyExc_ValueError, "drain_threshold must be at least 16");
        return -1;
    }
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &core_module);
    if (!module) return -1;
    self->state = get_state(module);
    bt_options opt;
    bt_options_init(&opt);
    opt.num_buckets = buckets;
    opt.drain_threshold = drain;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = bt_create(&opt, &self->core);
    Py_END_ALLOW_THREADS if (rc) {
        raise_errno(rc, "bt_create");
        return -1;
    }
    return 0;
}

static int TimerThread_traverse(TimerThreadObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->cached_loop);
    Py_VISIT(self->cached_port);
    Py_VISIT(self->dispatcher);
    return 0;
}

static int TimerThread_clear(TimerThreadObject *self) {
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    Py_CLEAR(self->dispatcher);
    return 0;
}

static void drop_handle(void *ctx, bt_port *port, void *payload) {
    (void)ctx;
    if (!port || !payload) return;
    HandleObject *h = (HandleObject *)payload;
    atomic_store(&h->state, H_DROPPED);
    handle_release_callback(h);
    Py_DECREF(h);
}

/* Stops the core and drops every pending or posted timer without running
 * it.  Returns how many were dropped. */
static int64_t close_core(TimerThreadObject *self) {
    if (!self->core || self->closed) return 0;
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS bt_stop(self->core);
    Py_END_ALLOW_THREADS return bt_drop_all(self->core, drop_handle, NULL);
}

static void TimerThread_dealloc(TimerThreadObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    TimerThread_clear(self);
    if (self->core) {
        /* No handle or port refers to us any more (they hold references),
         * so nothing is pending: stopping and freeing is safe. */
        close_core(self);
        Py_BEGIN_ALLOW_THREADS bt_destroy(self->core);
        Py_END_ALLOW_THREADS self->core = NULL;
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int check_open(TimerThreadObject *self) {
    if (!self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is not initialised");
        return -1;
    }
    if (self->closed || bt_is_stopped(self->core)) {
        raise_errno(bt_is_stopped(self->core) && !self->closed ? -ECHILD : -ESHUTDOWN, "");
        return -1;
    }
    return 0;
}

/* Finds the port for `loop` (None: the dispatcher).  Borrowed reference. */
static PortObject *port_for(TimerThreadObject *self, PyObject *loop) {
#ifndef Py_GIL_DISABLED
    if (loop == self->cached_loop && self->cached_port && bt_port_fd(self->cached_port->port) >= 0)
        return self->cached_port;
    if (loop == Py_None && self->dispatcher) return self->dispatcher;
#endif
    PyObject *p = PyObject_CallMethodOneArg((PyObject *)self, self->state->str_port_for, loop);
    if (!p) return NULL;
    if (!Py_IS_TYPE(p, self->state->Port_Type) || ((PortObject *)p)->tt != self) {
        Py_DECREF(p);
        PyErr_SetString(PyExc_TypeError, "_port_for must return a Port of this TimerThread");
        return NULL;
    }
#ifndef Py_GIL_DISABLED
    if (loop == Py_None) {
        Py_XSETREF(self->dispatcher, (PortObject *)Py_NewRef(p));
    } else {
        Py_XSETREF(self->cached_loop, Py_NewRef(loop));
        Py_XSETREF(self->cached_port, (PortObject *)Py_NewRef(p));
    }
#endif
    Py_DECREF(p); /* the TimerThread's _ports dict keeps it alive */
    return (PortObject *)p;
}

/* call_later(delay, callback, *args, loop=None, context=None) and call_at. */
static PyObject *schedule(TimerThreadObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames, int absolute) {
    const char *name = absolute ? "call_at" : "call_later";
    if (nargs < 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a %s and a callback", name,
                     absolute ? "deadline" : "delay");
        return NULL;
    }
    PyObject *loop = NULL, *context = NULL;
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (PyUnicode_CompareWithASCIIString(k, "loop") == 0) loop = args[nargs + i];
            else if (PyUnicode_CompareWithASCIIString(k, "context") == 0) context = args[nargs + i];
            else {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, k);
                return NULL;
            }
        }
    }
    if (check_open(self) < 0) return NULL;
    double t;
    if (to_seconds(args[0], absolute ? "when" : "delay", &t) < 0) return NULL;
    PyObject *cb = args[1];
    if (!PyCallable_Check(cb)) {
        PyErr_Format(PyExc_TypeError, "callback must be callable, not %.100s", Py_TYPE(cb)->tp_name);
        return NULL;
    }
    if (context == Py_None) context = NULL;
    if (context && !PyContext_CheckExact(context)) {
        PyErr_Format(PyExc_TypeError, "context must be a contextvars.Context, not %.100s",
                     Py_TYPE(context)->tp_name);
        return NULL;
    }

    /* Where it will be delivered. */
    PyObject *resolved = NULL;
    if (loop == NULL || loop == Py_None) {
        resolved = running_loop(self->state);
        if (!resolved) return NULL;
    } else {
        resolved = Py_NewRef(loop);
    }
    PortObject *port = port_for(self, resolved);
    Py_DECREF(resolved);
    if (!port) return NULL;

    int64_t deadline;
    double when;
    if (absolute) {
        when = t;
        deadline = when_to_ns(t);
    } else {
        int64_t now = bt_now_ns();
        if (t > 9.2e9) {
            deadline = INT64_MAX;
            when = INFINITY;
        } else {
            if (t < -9.2e9) t = -9.2e9;
            deadline = now + (int64_t)ceil(t * 1e9);
            if (t > 0 && deadline < now) deadline = INT64_MAX;
            when = (double)now / 1e9 + t;
        }
    }

    HandleObject *h = handle_alloc(self->state->Handle_Type);
    if (!h) return NULL;
    h->tt = (TimerThreadObject *)Py_NewRef(self);
    h->port = (PortObject *)Py_NewRef(port);
    h->when = when;
    h->callback = Py_NewRef(cb);
    h->args = tuple_from_array(args + 2, nargs - 2);
    h->context = context ? Py_NewRef(context) : PyContext_CopyCurrent();
    atomic_init(&h->state, H_PENDING);
    h->weakreflist = NULL;
    h->id = 0;
    PyObject_GC_Track(h);
    if (!h->args || !h->context) {
        Py_DECREF(h);
        return NULL;
    }
    /* The slot's reference, handed over at schedule. */
    Py_INCREF(h);
    int rc = bt_schedule_port(self->core, deadline, port->port, h, &h->id);
    if (rc) {
        Py_DECREF(h); /* the slot's */
        atomic_store(&h->state, H_DROPPED);
        Py_DECREF(h);
        return raise_errno(rc, name);
    }
    return (PyObject *)h;
}

static PyObject *TimerThread_call_later(TimerThreadObject *self, PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 0);
}

static PyObject *TimerThread_call_at(TimerThreadObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 1);
}

static PyObject *TimerThread_open_port(TimerThreadObject *self, PyObject *loop) {
    if (check_open(self) < 0) return NULL;
    bt_port *p;
    int rc = bt_port_open(self->core, 1, &p);
    if (rc) return raise_errno(rc, "bt_port_open");
    return (PyObject *)port_new(self, p, loop, 0);
}

static PyObject *TimerThread_orphans(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return raise_errno(-EINVAL, "orphans");
    return (PyObject *)port_new(self, bt_orphans(self->core), Py_None, 1);
}

static PyObject *TimerThread_close_core(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) Py_RETURN_NONE;
    int64_t n = close_core(self);
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    return PyLong_FromLongLong(n);
}

static PyObject *TimerThread_get_closed(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(!self->core || self->closed || bt_is_stopped(self->core));
}

static PyObject *TimerThread_time(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
}

static PyObject *TimerThread_stats(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return PyDict_New();
    bt_stats s;
    Py_BEGIN_ALLOW_THREADS bt_get_stats(self->core, &s);
    Py_END_ALLOW_THREADS PyObject *hist = PyList_New(48);
    if (!hist) return NULL;
    for (int i = 0; i < 48; i++) PyList_SET_ITEM(hist, i, PyLong_FromUnsignedLongLong(s.lateness_hist[i]));
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsNsI}", "scheduled", s.scheduled, "cancelled",
        s.cancelled, "fired", s.fired, "posted", s.posted, "ran", s.ran, "wakeups", s.wakeups,
        "passes", s.passes, "eventfd_writes", s.eventfd_writes, "drains", s.drains, "sweeps",
        s.sweeps, "reaped", s.reaped, "heap_size", s.heap_size, "list_size", s.list_size, "dead",
        s.dead, "slots", s.slots, "slots_free", s.slots_free, "ports", s.ports, "early_fires",
        s.early_fires, "lateness_hist", hist, "buckets", (unsigned int)0);
}

static PyMethodDef TimerThread_methods[] = {
    {"call_later", (PyCFunction)(void (*)(void))TimerThread_call_later,
     METH_FASTCALL | METH_KEYWORDS,
     "call_later(delay, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Run callback(*args) after delay seconds.  Inside a running event loop (or with loop=) it "
     "runs in that loop's thread; otherwise on this TimerThread's dispatcher thread."},
    {"call_at", (PyCFunction)(void (*)(void))TimerThread_call_at, METH_FASTCALL | METH_KEYWORDS,
     "call_at(when, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Like call_later, at time.monotonic() == when."},
    {"stats", (PyCFunction)TimerThread_stats, METH_NOARGS, "The core's counters, as a dict."},
    {"time", (PyCFunction)TimerThread_time, METH_NOARGS, "The core's clock: time.monotonic()."},
    {"_open_port", (PyCFunction)TimerThread_open_port, METH_O, NULL},
    {"_orphans", (PyCFunction)TimerThread_orphans, METH_NOARGS, NULL},
    {"_close_core", (PyCFunction)TimerThread_close_core, METH_NOARGS, NULL},
    {NULL}};

static PyGetSetDef TimerThread_getset[] = {
    {"closed", (getter)TimerThread_get_closed, NULL, "True once close() was called.", NULL},
    {NULL}};

static PyMemberDef TimerThread_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(TimerThreadObject, weakreflist), Py_READONLY},
    {NULL}};

static PyType_Slot TimerThread_slots[] = {
    {Py_tp_doc, "The native part of bucketimer.TimerThread."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, TimerThread_init},
    {Py_tp_dealloc, TimerThread_dealloc},
    {Py_tp_traverse, TimerThread_traverse},
    {Py_tp_clear, TimerThread_clear},
    {Py_tp_methods, TimerThread_methods},
    {Py_tp_getset, TimerThread_getset},
    {Py_tp_members, TimerThread_members},
    {0, NULL}};

static PyType_Spec TimerThread_spec = {
    .name = "bucketimer._core.TimerThread",
    .basicsize = sizeof(TimerThreadObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = TimerThread_slots,
};

/* ---- module ------------------------------------------------------------- */

static PyObject *core_monotonic_ns(PyObject *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(bt_now_ns());
}

static PyMethodDef core_functions[] = {
    {"monotonic_ns", core_monotonic_ns, METH_NOARGS, "The core's clock, CLOCK_MONOTONIC ns."},
    {NULL}};

static int core_exec(PyObject *m) {
    core_state *st = get_state(m);
    st->Handle_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!st->Handle_Type || PyModule_AddType(m, st->Handle_Type) < 0) return -1;
    st->Port_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Port_spec, NULL);
    if (!st->Port_Type || PyModule_AddType(m, st->Port_Type) < 0) return -1;
    st->TimerThread_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &TimerThread_spec, NULL);
    if (!st->TimerThread_Type || PyModule_AddType(m, st->TimerThread_Type) < 0) return -1;
    PyObject *events = PyImport_ImportModule("asyncio.events");
    if (!events) return -1;
    st->get_running_loop = PyObject_GetAttrString(events, "_get_running_loop");
    Py_DECREF(events);
    if (!st->get_running_loop) return -1;
    st->str_port_for = PyUnicode_InternFromString("_port_for");
    if (!st->str_port_for) return -1;
#if PY_VERSION_HEX < 0x030C0000
    pthread_once(&pid_once, install_pid_cache);
    st->str_running_loop_key = PyUnicode_InternFromString("__asyncio_running_event_loop__");
    if (!st->str_running_loop_key) return -1;
#endif
    if (PyModule_AddIntConstant(m, "CANCELLED", BT_CANCELLED) < 0) return -1;
    if (PyModule_AddIntConstant(m, "TOO_LATE", BT_TOO_LATE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "UNKNOWN", BT_UNKNOWN) < 0) return -1;
    return 0;
}

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    core_state *st = get_state(m);
    Py_VISIT(st->TimerThread_Type);
    Py_VISIT(st->Handle_Type);
    Py_VISIT(st->Port_Type);
    Py_VISIT(st->get_running_loop);
    return 0;
}

static int core_clear(PyObject *m) {
    core_state *st = get_state(m);
    Py_CLEAR(st->TimerThread_Type);
    Py_CLEAR(st->Handle_Type);
    Py_CLEAR(st->Port_Type);
    Py_CLEAR(st->get_running_loop);
    Py_CLEAR(st->str_port_for);
#if PY_VERSION_HEX < 0x030C0000
    Py_CLEAR(st->str_running_loop_key);
    Py_CLEAR(st->holder_type);
#endif
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL}};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bucketimer._core",
    .m_doc = "The CPython module over bucketimer's native timer core.",
    .m_size = sizeof(core_state),
    .m_methods = core_functions,
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
