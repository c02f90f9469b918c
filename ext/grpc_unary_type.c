/*
 * grpc_unary_type.c -- the per-call work of bucketimer.grpc's fused sync unary
 * wrapper (ServerDeadlineInterceptor inside SlowCallInterceptor, or
 * ServerDeadlineSlowCallInterceptor; docs/grpc.rst, "Both at once" and
 * "Costs") in C: what the Python wrapper in grpc/sync.py does per call,
 * without its frame.
 *
 * GrpcUnary is the wrapped behaviour (one per method, vectorcall).  Per
 * call it works out the budget, takes a GrpcCall from its own free list,
 * arms one timer on the dispatcher port (schedule.c's path; the callback is
 * the Python class's _fire with the call as its argument), sets the
 * ContextVar to the call (the budget remaining() reads), calls the
 * behaviour, resets the variable and cancels the timer.  Only when the timer
 * fired (a slow or expired call) or the behaviour raised does it call back
 * into Python (the class's _tail and _end_expired_slow).
 *
 * GrpcCall is the call: the handler's context proxy and the timer's
 * payload.  Its fields are the attributes the Python methods of its
 * per-method subclass read and write (grpc/sync.py, _NativeBothContext);
 * that subclass adds nothing to the layout (__slots__ = ()), so the free
 * list of a GrpcUnary, which only ever holds calls of its own class, can
 * hand one back out as it is.  Everything here runs with the GIL held.
 *
 * The layout, the construction and the start of a call are shared with the
 * aio wrapper (grpc_aio_type.c) through grpc_call.h.
 */
#include "grpc_call.h"

#if PY_VERSION_HEX < 0x030C0000
#define Py_T_DOUBLE T_DOUBLE
#define Py_T_BOOL T_BOOL
#define Py_T_OBJECT T_OBJECT
#define Py_T_ULONG T_ULONG
#define Py_T_INT T_INT
#endif

/* Above this, a server's time_remaining() means "no deadline" (grpc/_common.py). */
#define NO_DEADLINE 1e9

/* ---- GrpcCall ----------------------------------------------------------------------- */

EXT_GC_TRAVERSE(GrpcCall, GrpcCallObject, GRPC_CALL_REFS)
EXT_GC_CLEAR(GrpcCall, GrpcCallObject, GRPC_CALL_REFS)

static void GrpcCall_dealloc(GrpcCallObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GrpcUnaryObject *w = self->wrapper;
    self->wrapper = NULL;
    GrpcCall_clear(self);
    /* Back to the wrapper it came from, if it is still of the wrapper's class
     * (the free list then hands it out as one without a new type check). */
    if (w && tp == w->cls && ext_freelist_put(&w->calls, (PyObject *)self)) {
        Py_DECREF(w);
        return;
    }
    tp->tp_free(self);
    Py_DECREF(tp);
    Py_XDECREF(w);
}

static PyObject *GrpcCall_new(PyTypeObject *Py_UNUSED(tp), PyObject *Py_UNUSED(a),
                              PyObject *Py_UNUSED(k)) {
    PyErr_SetString(PyExc_TypeError, "a GrpcCall is made by its GrpcUnary, per call");
    return NULL;
}

/* Python reads every field; it writes only those the C wrappers never read
 * (the flags, _handle2, _abort, _bound and _claimed, which the Python
 * methods keep).  The rest are
 * read-only (module.h, "fields Python can reach"): the wrappers use _handle
 * and _deadline after the handler, which receives this object, has run. */
#define CALL_MEMBER(name, type, field, flags) \
    {name, type, offsetof(GrpcCallObject, field), flags, NULL}
static PyMemberDef GrpcCall_members[] = {
    CALL_MEMBER("_ctx", Py_T_OBJECT_EX, ctx, Py_READONLY),
    CALL_MEMBER("_deadline", Py_T_OBJECT_EX, deadline, Py_READONLY),
    CALL_MEMBER("_source", Py_T_OBJECT_EX, source, Py_READONLY),
    CALL_MEMBER("_task", Py_T_OBJECT_EX, task, Py_READONLY),
    CALL_MEMBER("_handle", Py_T_OBJECT_EX, handle, Py_READONLY),
    CALL_MEMBER("_handle2", Py_T_OBJECT_EX, handle2, 0),
    CALL_MEMBER("_start", Py_T_DOUBLE, start, Py_READONLY),
    CALL_MEMBER("_ident", Py_T_ULONG, ident, Py_READONLY),
    CALL_MEMBER("_expired", Py_T_BOOL, expired, 0),
    CALL_MEMBER("_done", Py_T_BOOL, done, 0),
    CALL_MEMBER("_slow", Py_T_BOOL, slow, 0),
    CALL_MEMBER("_first_slow", Py_T_BOOL, first_slow, Py_READONLY),
    CALL_MEMBER("_where", Py_T_OBJECT_EX, where, Py_READONLY),
    CALL_MEMBER("_abort", Py_T_OBJECT_EX, abort, 0),
    CALL_MEMBER("_bound", Py_T_DOUBLE, bound, 0),
    CALL_MEMBER("_claimed", Py_T_INT, claimed, 0),
    {NULL}};

static PyType_Slot GrpcCall_slots[] = {
    {Py_tp_doc, "One call served by a GrpcUnary: the handler's context proxy and the "
                "timer's payload.  Subclassed per method by bucketimer.grpc."},
    {Py_tp_new, GrpcCall_new},
    {Py_tp_dealloc, GrpcCall_dealloc},
    {Py_tp_traverse, GrpcCall_traverse},
    {Py_tp_clear, GrpcCall_clear},
    {Py_tp_members, GrpcCall_members},
    {0, NULL}};

PyType_Spec GrpcCall_spec = {
    .name = "bucketimer._core.GrpcCall",
    .basicsize = sizeof(GrpcCallObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = GrpcCall_slots,
};

/* ---- GrpcUnary ---------------------------------------------------------------------- */

EXT_GC_TRAVERSE(GrpcUnary, GrpcUnaryObject, GRPC_UNARY_REFS)

int ext_grpc_unary_traverse(GrpcUnaryObject *self, visitproc visit, void *arg) {
    return GrpcUnary_traverse(self, visit, arg);
}

int ext_grpc_unary_clear(GrpcUnaryObject *self) {
    ext_freelist_clear(&self->calls);
    GRPC_UNARY_REFS(EXT_CLEAR_REF)
    return 0;
}

void ext_grpc_unary_dealloc(GrpcUnaryObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ext_grpc_unary_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Is `tt` a TimerThread whose call_at is the core's own (not overridden)? */
static int is_native_tt(ext_state *st, PyObject *tt) {
    if (!PyObject_TypeCheck(tt, st->TimerThread_Type)) return 0;
    if (Py_IS_TYPE(tt, st->TimerThread_Type)) return 1;
    PyObject *mine = PyObject_GetAttrString((PyObject *)Py_TYPE(tt), "call_at");
    PyObject *core = PyObject_GetAttrString((PyObject *)st->TimerThread_Type, "call_at");
    int same = mine && core && mine == core;
    Py_XDECREF(mine);
    Py_XDECREF(core);
    if (PyErr_Occurred()) return -1;
    return same;
}

/* The TimerThread to arm on (a new reference) and whether it is native:
 * the last one, unless it is closed (then timers() again), as the
 * interceptors' _live_tt does.  Asking a stand-in whether it is closed
 * runs Python code, which may call this wrapper and replace w->tt: the
 * answer is about the one held here. */
static PyObject *live_tt(GrpcUnaryObject *w, int *native) {
    PyObject *tt = Py_XNewRef(w->tt);
    *native = w->tt_native;
    if (tt) {
        if (*native) {
            TimerThreadObject *t = (TimerThreadObject *)tt;
            if (t->core && !t->closed && !bt_is_stopped(t->core)) return tt;
        } else {
            PyObject *closed = PyObject_GetAttr(tt, w->str_closed);
            int c = closed ? PyObject_IsTrue(closed) : -1;
            Py_XDECREF(closed);
            if (c <= 0) {
                if (c < 0) Py_CLEAR(tt);
                return tt;
            }
        }
        Py_DECREF(tt);
    }
    PyObject *n = PyObject_CallNoArgs(w->timers);
    if (!n) return NULL;
    *native = is_native_tt(w->st, n);
    if (*native < 0) {
        Py_DECREF(n);
        return NULL;
    }
    Py_XSETREF(w->tt, Py_NewRef(n));
    w->tt_native = *native;
    return n;
}

/* A new call of w->cls, its fields set but for the timer (NULL on error). */
static GrpcCallObject *call_new(GrpcUnaryObject *w, PyObject *ctx) {
    GrpcCallObject *c = (GrpcCallObject *)ext_freelist_take(&w->calls, w->cls);
    if (!c) {
        c = (GrpcCallObject *)w->cls->tp_alloc(w->cls, 0); /* tracked, zeroed */
        if (!c) return NULL;
        PyObject_GC_UnTrack(c);
    }
    c->wrapper = (GrpcUnaryObject *)Py_NewRef(w);
    c->ctx = Py_NewRef(ctx);
    c->deadline = NULL;
    c->source = NULL;
    c->task = Py_NewRef(Py_None);
    c->handle = NULL;
    c->handle2 = Py_NewRef(Py_None);
    c->where = NULL;
    c->abort = Py_NewRef(Py_None);
    c->start = 0.0;
    c->bound = INFINITY;
    c->ident = PyThread_get_thread_ident();
    c->claimed = 0;
    c->expired = c->done = c->slow = c->first_slow = 0;
    PyObject_GC_Track(c);
    return c;
}

int ext_grpc_cancel_timer(GrpcUnaryObject *w, PyObject *h) {
    if (Py_IS_TYPE(h, w->st->Handle_Type)) return ext_handle_cancel((HandleObject *)h);
    PyObject *r = PyObject_CallMethodNoArgs(h, w->str_cancel);
    if (!r) return -1;
    int ok = PyObject_IsTrue(r);
    Py_DECREF(r);
    return ok;
}

/* The timer at `when` for w->fire(c) on `tt` (`native`: a TimerThread of
 * the core's), delivered to `loop` (None: the dispatcher); a stand-in
 * TimerThread's call_at chooses for itself. */
static PyObject *arm(GrpcUnaryObject *w, PyObject *tt, int native, double when,
                     GrpcCallObject *c, PyObject *loop) {
    PyObject *arg = (PyObject *)c;
    if (native)
        return ext_schedule((TimerThreadObject *)tt, 1, when, w->fire, &arg, 1, loop, NULL, 0);
    PyObject *t = PyFloat_FromDouble(when);
    if (!t) return NULL;
    PyObject *h = PyObject_CallMethodObjArgs(tt, w->str_call_at, t, w->fire, arg, NULL);
    Py_DECREF(t);
    return h;
}

/* The budget, as _FusedCall._begin_both works it out: *deadline NaN if none. */
static int budget(GrpcUnaryObject *w, PyObject *ctx, double now, double *deadline,
                  PyObject **source) {
    PyObject *rem = PyObject_CallMethodNoArgs(ctx, w->str_time_remaining);
    if (!rem) return -1;
    double r = 0.0;
    int none = rem == Py_None;
    if (!none) {
        r = PyFloat_AsDouble(rem);
        if (r == -1.0 && PyErr_Occurred()) {
            Py_DECREF(rem);
            return -1;
        }
    }
    Py_DECREF(rem);
    double max_time = w->max_time;
    *deadline = NAN;
    *source = NULL;
    if (none || r >= NO_DEADLINE) {
        if (!isnan(max_time)) *deadline = now + max_time, *source = w->str_max_time;
    } else if (!isnan(max_time) && max_time < r) {
        *deadline = now + max_time, *source = w->str_max_time;
    } else {
        *deadline = now + (r > 0.0 ? r : 0.0), *source = w->str_client;
    }
    return 0;
}

GrpcCallObject *ext_grpc_call_begin(GrpcUnaryObject *w, PyObject *ctx, PyObject *task,
                                    PyObject *loop) {
    double now = (double)bt_now_ns() / 1e9; /* time.monotonic() */
    double deadline;
    PyObject *source;
    if (budget(w, ctx, now, &deadline, &source) < 0) return NULL;
    int has_deadline = !isnan(deadline);
    GrpcCallObject *c = call_new(w, ctx);
    if (!c) return NULL;
    if (task) Py_SETREF(c->task, Py_NewRef(task));
    c->start = now;
    if (has_deadline) {
        c->deadline = PyFloat_FromDouble(deadline);
        if (!c->deadline) goto fail;
        c->source = Py_NewRef(source);
    } else {
        c->deadline = Py_NewRef(Py_None);
    }
    double first = now + w->threshold;
    c->first_slow = 1;
    /* a client budget: its early look (grpc ends a call for the client's
     * deadline a moment before ours; before that, only for a cancel) */
    double due = has_deadline && source == w->str_client ? deadline - w->early : deadline;
    if (has_deadline && due < first) {
        first = due;
        c->first_slow = 0;
    }
    int native;
    PyObject *tt = live_tt(w, &native);
    if (!tt) goto fail;
    c->handle = arm(w, tt, native, first, c, loop);
    Py_DECREF(tt);
    if (!c->handle) goto fail;
    return c;
fail:
    Py_DECREF(c);
    return NULL;
}

static PyObject *GrpcUnary_vectorcall(GrpcUnaryObject *w, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a unary behaviour takes (request, context)");
        return NULL;
    }
    if (!w->cls) { /* cleared by the GC, then called from a finalizer */
        PyErr_SetString(PyExc_RuntimeError, "this GrpcUnary was cleared");
        return NULL;
    }
    PyObject *request = args[0], *ctx = args[1];
    GrpcCallObject *c = ext_grpc_call_begin(w, ctx, NULL, Py_None); /* the dispatcher */
    if (!c) return NULL;
    int has_deadline = c->deadline != Py_None;
    PyObject *token = NULL, *res = NULL;
    /* the call is the budget remaining() reads and propagation notes on */
    token = PyContextVar_Set(w->var, has_deadline ? (PyObject *)c : Py_None);
    if (!token) {
        c->done = 1;
        if (ext_grpc_cancel_timer(w, c->handle) < 0) PyErr_WriteUnraisable((PyObject *)w);
        goto done;
    }

    PyObject *bargs[2] = {request, has_deadline ? (PyObject *)c : ctx};
    res = PyObject_Vectorcall(w->behavior, bargs, 2, NULL);
    PyObject *exc = res ? NULL : PyErr_GetRaisedException();

    c->done = 1;
    int cancelled = ext_grpc_cancel_timer(w, c->handle);
    PyObject *slow = NULL; /* set: the call expired (True if it was slow too) */
    if (cancelled < 0) {   /* a stand-in handle's cancel() raised: that, not the result */
        Py_CLEAR(res);
        Py_CLEAR(exc);
        exc = PyErr_GetRaisedException();
    } else if (!cancelled || exc) { /* it fired, or the handler raised: Python says how it ends */
        /* as in the Python wrapper's `except` block: exc is being handled */
        PyObject *handled = exc ? PyErr_GetHandledException() : NULL;
        if (exc) PyErr_SetHandledException(exc);
        PyObject *act = PyObject_CallFunctionObjArgs(w->tail, (PyObject *)c,
                                                     exc ? exc : Py_None, NULL);
        if (exc) {
            PyErr_SetHandledException(handled);
            Py_XDECREF(handled);
        }
        if (!act) {
            Py_CLEAR(res);
            Py_CLEAR(exc);
            exc = PyErr_GetRaisedException();
        } else if (act == Py_None) {
            Py_DECREF(act);
        } else {
            slow = act;
            Py_CLEAR(res);
            Py_CLEAR(exc);
        }
    }
    if (PyContextVar_Reset(w->var, token) < 0) { /* cannot fail for our own token */
        Py_CLEAR(res);
        Py_XDECREF(exc);
        Py_XDECREF(slow);
        exc = NULL, slow = NULL;
        goto done;
    }
    if (slow) {
        res = PyObject_CallFunctionObjArgs(w->end_expired, (PyObject *)c, slow, NULL);
        Py_DECREF(slow);
    } else if (exc) {
        PyErr_SetRaisedException(exc);
    }
done:
    Py_XDECREF(token);
    Py_DECREF(c);
    return res;
}

static PyObject *get_attr(PyObject *o, const char *name) {
    return PyObject_GetAttrString(o, name);
}

GrpcUnaryObject *ext_grpc_unary_make(PyTypeObject *tp, vectorcallfunc vectorcall, PyObject *cls,
                                     PyObject *behavior, PyObject *var, PyObject *timers,
                                     double threshold, PyObject *max_time_o) {
    ext_state *st = ext_state_of_type(tp);
    if (!st) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, st->GrpcCall_Type) ||
        ((PyTypeObject *)cls)->tp_basicsize != st->GrpcCall_Type->tp_basicsize ||
        ((PyTypeObject *)cls)->tp_dictoffset || ((PyTypeObject *)cls)->tp_weaklistoffset) {
        PyErr_SetString(PyExc_TypeError,
                        "call_type must be a GrpcCall subclass with __slots__ = () throughout");
        return NULL;
    }
    if (!PyCallable_Check(behavior) || !PyCallable_Check(timers)) {
        PyErr_SetString(PyExc_TypeError, "behavior and timers must be callable");
        return NULL;
    }
    double max_time = NAN;
    if (max_time_o != Py_None) {
        max_time = PyFloat_AsDouble(max_time_o);
        if (max_time == -1.0 && PyErr_Occurred()) return NULL;
        if (isnan(max_time)) {
            PyErr_SetString(PyExc_ValueError, "max_time must not be NaN");
            return NULL;
        }
    }
    if (isnan(threshold)) {
        PyErr_SetString(PyExc_ValueError, "threshold must not be NaN");
        return NULL;
    }
    GrpcUnaryObject *w = (GrpcUnaryObject *)tp->tp_alloc(tp, 0);
    if (!w) return NULL;
    w->vectorcall = vectorcall;
    w->st = st;
    ext_freelist_init(&w->calls, w->call_store, GRPC_CALL_FREELIST, 1);
    w->cls = (PyTypeObject *)Py_NewRef(cls);
    w->behavior = Py_NewRef(behavior);
    w->var = Py_NewRef(var);
    w->timers = Py_NewRef(timers);
    w->threshold = threshold;
    w->max_time = max_time;
    /* how long before a client's deadline the call looks (none: 0) */
    PyObject *early = get_attr(cls, "_early");
    if (!early && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        early = PyFloat_FromDouble(0.0);
    }
    w->early = early ? PyFloat_AsDouble(early) : -1.0;
    Py_XDECREF(early);
    if (w->early == -1.0 && PyErr_Occurred()) {
        Py_DECREF(w);
        return NULL;
    }
    if (!(w->fire = get_attr(cls, "_fire")) || !(w->tail = get_attr(cls, "_tail")) ||
        !(w->str_time_remaining = PyUnicode_InternFromString("time_remaining")) ||
        !(w->str_max_time = PyUnicode_InternFromString("max_time")) ||
        !(w->str_client = PyUnicode_InternFromString("client")) ||
        !(w->str_closed = PyUnicode_InternFromString("closed")) ||
        !(w->str_call_at = PyUnicode_InternFromString("call_at")) ||
        !(w->str_cancel = PyUnicode_InternFromString("cancel"))) {
        Py_DECREF(w);
        return NULL;
    }
    return w;
}

/* GrpcUnary(cls, behavior, var, timers, threshold, max_time) */
static PyObject *GrpcUnary_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    PyObject *cls, *behavior, *var, *timers, *max_time_o;
    double threshold;
    static char *kw[] = {"call_type", "behavior", "var", "timers", "threshold", "max_time", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!OdO:GrpcUnary", kw, &PyType_Type, &cls,
                                     &behavior, &PyContextVar_Type, &var, &timers, &threshold,
                                     &max_time_o))
        return NULL;
    GrpcUnaryObject *w = ext_grpc_unary_make(tp, (vectorcallfunc)GrpcUnary_vectorcall, cls,
                                             behavior, var, timers, threshold, max_time_o);
    if (w && !(w->end_expired = get_attr(cls, "_end_expired_slow"))) Py_CLEAR(w);
    return (PyObject *)w;
}

/* (a wrapper the GC cleared has neither: None) */
static PyObject *GrpcUnary_get_behavior(GrpcUnaryObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->behavior ? self->behavior : Py_None);
}

static PyObject *GrpcUnary_get_cls(GrpcUnaryObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->cls ? (PyObject *)self->cls : Py_None);
}

static PyObject *GrpcUnary_get_free(GrpcUnaryObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromLong(self->calls.n);
}

PyGetSetDef ext_grpc_unary_getset[] = {
    {"behavior", (getter)GrpcUnary_get_behavior, NULL, "The wrapped behaviour.", NULL},
    {"call_type", (getter)GrpcUnary_get_cls, NULL, "The class of its calls.", NULL},
    {"free_calls", (getter)GrpcUnary_get_free, NULL,
     "How many ended calls its free list keeps for reuse.", NULL},
    {NULL}};

PyMemberDef ext_grpc_unary_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(GrpcUnaryObject, vectorcall), Py_READONLY,
     NULL},
    {"__dictoffset__", Py_T_PYSSIZET, offsetof(GrpcUnaryObject, dict), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot GrpcUnary_slots[] = {
    {Py_tp_doc, "GrpcUnary(call_type, behavior, var, timers, threshold, max_time)\n\n"
                "A sync unary behaviour served under a slow-call threshold and a deadline "
                "with one timer per call (bucketimer.grpc)."},
    {Py_tp_new, GrpcUnary_new},
    {Py_tp_dealloc, ext_grpc_unary_dealloc},
    {Py_tp_traverse, GrpcUnary_traverse},
    {Py_tp_clear, ext_grpc_unary_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getset, ext_grpc_unary_getset},
    {Py_tp_members, ext_grpc_unary_members},
    {0, NULL}};

PyType_Spec GrpcUnary_spec = {
    .name = "bucketimer._core.GrpcUnary",
    .basicsize = sizeof(GrpcUnaryObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = GrpcUnary_slots,
};
