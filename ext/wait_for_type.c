/*
 * wait_for_type.c -- wait_for() of 3.12 and later: asyncio's coroutine
 * `async with timeout(t): return await fut`, written out by hand as a C
 * coroutine object (send/throw/close, __await__, a finaliser), over
 * timeout_type.c's enter and exit.  See the section comment below.  A WaitFor is
 * touched only with the GIL held, by whoever drives it (its `running` flag
 * refuses a re-entrant send/throw/close); it holds no core lock.
 *
 * It also owns the C coroutine shell (module.h, ext_coro) that WaitFor and
 * grpc_aio_type.c's GrpcAioCoro share: the generator protocol's rules, the
 * send/throw/close methods, __await__, the finaliser and the cr_* attributes,
 * around each kind's own start and resume.
 */
#include "module.h"

#include <frameobject.h>

/* ---- wait_for: asyncio.wait_for of 3.12 and later, in C -----------------
 *
 * 3.12 rewrote wait_for() as
 *
 *     async def wait_for(fut, timeout):
 *         if timeout is not None and timeout <= 0:
 *             ...                    # run to completion or cancel, see aio.py
 *         async with timeouts.timeout(timeout):
 *             return await fut
 *
 * WaitFor is that coroutine written out by hand, so that a wait_for() whose
 * awaitable finishes without suspending costs no Python frame, no
 * `async with` and no Ready awaitables: it enters a Timeout, drives the
 * awaited iterator with send()/throw(), and exits the Timeout with whatever
 * that iterator ended with.  It is a coroutine as asyncio sees one
 * (collections.abc.Coroutine: __await__, send, throw, close), so
 * create_task(), gather() and TaskGroup take it, and it follows the
 * generator protocol's rules: re-use after the end, throw() before the
 * start, close() while suspended, finalisation while suspended (which, like
 * a coroutine's close(), exits the Timeout and so cancels its timer).
 *
 * The `timeout <= 0` branch runs aio.py's coroutine for it: it involves a
 * Task and is not a fast path in asyncio either. */

#if PY_VERSION_HEX >= 0x030C0000

typedef struct {
    ext_coro co;       /* state and running flag: the shell's */
    PyObject *fut;     /* what to await, until started */
    PyObject *delay;   /* the timeout argument, until started */
    PyObject *inner;   /* the iterator being awaited, while suspended */
    PyObject *timeout; /* the entered Timeout, while suspended; NULL for timeout <= 0 */
} WaitForObject;
#define WAITFOR_REFS(X) X(fut) X(delay) X(inner) X(timeout)

EXT_GC_TRAVERSE(WaitFor, WaitForObject, WAITFOR_REFS)

/* Cleared by the GC, it is closed: a finaliser that reaches it afterwards
 * finds a coroutine that cannot be driven again. */
static int WaitFor_clear(WaitForObject *self) {
    self->co.state = EXT_CORO_CLOSED;
    WAITFOR_REFS(EXT_CLEAR_REF)
    return 0;
}

static void WaitFor_dealloc(WaitForObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    WaitFor_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* 1 if `o` is a coroutine, or a generator marked as one, as `await` sees it. */
static int is_coroutine(PyObject *o) {
    return PyCoro_CheckExact(o) ||
           (PyGen_CheckExact(o) &&
            (PyGen_GetCode((PyGenObject *)o)->co_flags & CO_ITERABLE_COROUTINE));
}

/* The TypeErrors of `await o`, worded as the running interpreter words
 * them: `res` is what o.__await__() returned, or NULL if o has none. */
static PyObject *not_awaitable(PyObject *o, PyObject *res) {
#if PY_VERSION_HEX >= 0x030F0000
    if (res)
        return PyErr_Format(PyExc_TypeError, "%T.__await__() must return an iterator, not %T", o,
                            res);
    return PyErr_Format(PyExc_TypeError, "'%T' object can't be awaited", o);
#else
    if (res && is_coroutine(res))
        return PyErr_Format(PyExc_TypeError, "__await__() returned a coroutine");
    if (res)
        return PyErr_Format(PyExc_TypeError, "__await__() returned non-iterator of type '%.100s'",
                            Py_TYPE(res)->tp_name);
#if PY_VERSION_HEX >= 0x030E0000
    return PyErr_Format(PyExc_TypeError, "'%T' object can't be awaited", o);
#else
    return PyErr_Format(PyExc_TypeError, "object %.100s can't be used in 'await' expression",
                        Py_TYPE(o)->tp_name);
#endif
#endif
}

/* What `await o` iterates: the interpreter's GET_AWAITABLE. */
PyObject *ext_awaitable_iter(ext_state *st, PyObject *o) {
    if (is_coroutine(o)) {
        if (PyCoro_CheckExact(o)) {
            /* a coroutine suspended in an await of its own is someone
             * else's to drive */
            PyObject *yf = ext_coro_await(&st->compat, o);
            if (!yf) return NULL;
            int busy = yf != Py_None;
            Py_DECREF(yf);
            if (busy) {
                PyErr_SetString(PyExc_RuntimeError, "coroutine is being awaited already");
                return NULL;
            }
        }
        return Py_NewRef(o);
    }
    unaryfunc getter = Py_TYPE(o)->tp_as_async ? Py_TYPE(o)->tp_as_async->am_await : NULL;
    if (!getter) return not_awaitable(o, NULL);
    PyObject *res = getter(o);
    if (!res) return NULL;
    if (is_coroutine(res) || !PyIter_Check(res)) {
        not_awaitable(o, res);
        Py_DECREF(res);
        return NULL;
    }
    return res;
}

/* Sets `exc` (stolen) as the raised exception, with `context` (stolen) as
 * its __context__ unless it already is in its chain: what raising inside
 * an `except` block does. */
void ext_raise_with_context(PyObject *exc, PyObject *context) {
    if (context && context != exc) {
        PyObject *c = PyException_GetContext(exc);
        if (!c) PyException_SetContext(exc, context);
        else {
            Py_DECREF(c);
            Py_DECREF(context);
        }
    } else {
        Py_XDECREF(context);
    }
    PyErr_SetRaisedException(exc);
}

/* The end of `async with timeout: return await fut`: the awaited iterator
 * returned (*result) or raised (the current exception).  Exits the
 * Timeout with that outcome; its TimeoutError, if it raises one, wins. */
static PySendResult waitfor_finish(WaitForObject *self, PySendResult r, PyObject **result) {
    TimeoutObject *tm = (TimeoutObject *)self->timeout;
    self->timeout = NULL;
    self->co.state = EXT_CORO_CLOSED;
    /* the iterator's __del__ runs with no exception pending */
    PyObject *raised = r == PYGEN_ERROR ? PyErr_GetRaisedException() : NULL;
    Py_CLEAR(self->inner);
    if (raised) PyErr_SetRaisedException(raised);
    if (!tm) return r;
    if (r == PYGEN_RETURN) {
        if (ext_timeout_exit(tm, Py_None, Py_None) < 0) {
            Py_CLEAR(*result);
            r = PYGEN_ERROR;
        }
    } else {
        PyObject *exc = PyErr_GetRaisedException();
        /* __aexit__ runs while `exc` is the exception being handled, as in
         * the `async with` it stands for: what it raises gets `exc` as
         * __context__, not whatever the awaiting code was handling. */
        PyObject *handled = PyErr_GetHandledException();
        PyErr_SetHandledException(exc);
        int rc = ext_timeout_exit(tm, (PyObject *)Py_TYPE(exc), exc);
        PyErr_SetHandledException(handled);
        Py_XDECREF(handled);
        if (rc == 0) PyErr_SetRaisedException(exc); /* __aexit__ never swallows */
        else ext_raise_with_context(PyErr_GetRaisedException(), exc);
    }
    Py_DECREF(tm);
    return r;
}

/* The StopIteration that ends a throw() or send() call: its value. */
PySendResult ext_fetch_return(PyObject **result) {
    if (!PyErr_ExceptionMatches(PyExc_StopIteration)) return PYGEN_ERROR;
    PyObject *e = PyErr_GetRaisedException();
    PyObject *v = ((PyStopIterationObject *)e)->value;
    *result = Py_NewRef(v ? v : Py_None);
    Py_DECREF(e);
    return PYGEN_RETURN;
}

/* Calls close() of an iterator, if it has one (`it`: the caller's reference). */
int ext_close_iter(ext_state *st, PyObject *it) {
    PyObject *meth;
    if (optional_attr(it, st->str_close, &meth) < 0) return -1;
    if (!meth) return 0;
    PyObject *r = PyObject_CallNoArgs(meth);
    Py_DECREF(meth);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* throw(exc) into the awaited iterator, as `yield from` does: GeneratorExit
 * closes it and is raised here; an iterator without throw() lets the
 * exception be raised here.  `inner` and `exc` are the caller's references,
 * held across the Python code this runs. */
PySendResult ext_throw_into(ext_state *st, PyObject *inner, PyObject *exc, PyObject **result) {
    if (PyErr_GivenExceptionMatches(exc, PyExc_GeneratorExit)) {
        if (ext_close_iter(st, inner) < 0) return PYGEN_ERROR; /* that error is raised instead */
        PyErr_SetRaisedException(Py_NewRef(exc));
        return PYGEN_ERROR;
    }
    PyObject *meth;
    int found = optional_attr(inner, st->str_throw, &meth);
    if (found < 0) return PYGEN_ERROR;
    if (!found) {
        PyErr_SetRaisedException(Py_NewRef(exc));
        return PYGEN_ERROR;
    }
    PyObject *ret = PyObject_CallOneArg(meth, exc);
    Py_DECREF(meth);
    if (ret) {
        *result = ret;
        return PYGEN_NEXT;
    }
    return ext_fetch_return(result);
}

/* `timeout <= 0`: 1, 0, or -1 with an error (asyncio compares with 0). */
static int is_nonpositive(PyObject *delay) {
    if (PyFloat_CheckExact(delay)) return PyFloat_AS_DOUBLE(delay) <= 0.0;
    if (PyLong_CheckExact(delay)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(delay, &overflow);
        if (v != -1 || !PyErr_Occurred()) return overflow ? overflow < 0 : v <= 0;
        return -1;
    }
    PyObject *zero = PyLong_FromLong(0);
    int r = zero ? PyObject_RichCompareBool(delay, zero, Py_LE) : -1;
    Py_XDECREF(zero);
    return r;
}

/* Starts awaiting `inner` (stolen): the first send, and the end of the
 * coroutine if it does not suspend. */
static PySendResult waitfor_first_send(WaitForObject *self, PyObject *inner,
                                       PyObject **result) {
    self->co.state = EXT_CORO_SUSPENDED;
    self->inner = Py_NewRef(inner); /* (the send holds its own) */
    PySendResult r = PyIter_Send(inner, Py_None, result);
    Py_DECREF(inner);
    return r == PYGEN_NEXT ? r : waitfor_finish(self, r, result);
}

/* `timeout <= 0`: aio.py's coroutine, which gives a coroutine no chance to
 * run (it involves a Task: not a fast path in asyncio either). */
static PySendResult waitfor_start_nonpositive(WaitForObject *self, PyObject *fut,
                                              PyObject **result) {
    ext_state *st = self->co.st;
    if (!st->wait_for_nonpositive) {
        PyErr_SetString(PyExc_RuntimeError, "bucketimer.aio is not initialised");
        return PYGEN_ERROR;
    }
    PyObject *loop = ext_need_running_loop(st);
    if (!loop) return PYGEN_ERROR;
    /* held: the call may replace it (_set_wait_for_nonpositive) */
    PyObject *fn = Py_NewRef(st->wait_for_nonpositive);
    PyObject *inner = PyObject_CallFunctionObjArgs(fn, fut, loop, NULL);
    Py_DECREF(fn);
    Py_DECREF(loop);
    return inner ? waitfor_first_send(self, inner, result) : PYGEN_ERROR;
}

/* timeout(delay) and its __aenter__, back to back as in asyncio's wait_for:
 * the same running loop, and the clock read once (asyncio reads it twice, a
 * few hundred ns apart, and schedules in between nothing that could tell).
 * The entered Timeout, or NULL. */
static PyObject *waitfor_enter(ext_state *st, PyObject *delay) {
    PyObject *loop = ext_need_running_loop(st);
    if (!loop) return NULL;
    int64_t now_ns;
    PyObject *tm = ext_timeout_on_loop(st, loop, delay, &now_ns);
    if (tm && ext_timeout_enter((TimeoutObject *)tm, loop, now_ns) < 0) Py_CLEAR(tm);
    Py_DECREF(loop);
    return tm;
}

/* The first send(None): the body up to the first suspension. */
static PySendResult waitfor_start(WaitForObject *self, PyObject **result) {
    PyObject *fut = self->fut, *delay = self->delay;
    self->fut = self->delay = NULL;
    self->co.state = EXT_CORO_CLOSED; /* until the Timeout is entered */
    PySendResult r = PYGEN_ERROR;
    int nonpositive = delay == Py_None ? 0 : is_nonpositive(delay);
    if (nonpositive > 0) {
        r = waitfor_start_nonpositive(self, fut, result);
    } else if (nonpositive == 0) {
        self->timeout = waitfor_enter(self->co.st, delay);
        if (self->timeout) {
            self->co.state = EXT_CORO_SUSPENDED;
            PyObject *inner = ext_awaitable_iter(self->co.st, fut);
            r = inner ? waitfor_first_send(self, inner, result)
                      : waitfor_finish(self, PYGEN_ERROR, result);
        }
    }
    Py_DECREF(fut);
    Py_DECREF(delay);
    return r;
}

/* A later step: send(arg) when exc is NULL, else throw(exc). */
static PySendResult waitfor_resume(ext_coro *co, PyObject *arg, PyObject *exc,
                                   PyObject **result) {
    WaitForObject *self = (WaitForObject *)co;
    if (!self->inner) { /* (suspended, it has one; a cleared one is closed) */
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    PyObject *inner = Py_NewRef(self->inner);
    PySendResult r = exc ? ext_throw_into(self->co.st, inner, exc, result)
                         : PyIter_Send(inner, arg, result);
    Py_DECREF(inner);
    return r == PYGEN_NEXT ? r : waitfor_finish(self, r, result);
}

static PySendResult waitfor_start_co(ext_coro *co, PyObject **result) {
    return waitfor_start((WaitForObject *)co, result);
}

static void waitfor_discard(ext_coro *co) {
    WaitForObject *self = (WaitForObject *)co;
    Py_CLEAR(self->fut);
    Py_CLEAR(self->delay);
}

static PyObject *waitfor_awaiting(ext_coro *co) { return ((WaitForObject *)co)->inner; }

static const ext_coro_kind waitfor_kind = {
    "wait_for", waitfor_start_co, waitfor_resume, waitfor_discard, waitfor_awaiting};

/* ---- the C coroutine shell: what every C coroutine of the module shares --- */

PySendResult ext_coro_step(ext_coro *self, PyObject *arg, PyObject *exc, PyObject **result) {
    *result = NULL;
    if (self->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return PYGEN_ERROR;
    }
    if (self->state == EXT_CORO_CLOSED) {
        if (exc) PyErr_SetRaisedException(Py_NewRef(exc));
        else PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    if (self->state == EXT_CORO_CREATED) {
        if (exc) { /* thrown in before it started: nothing ran, it never will */
            self->state = EXT_CORO_CLOSED;
            self->kind->discard(self);
            PyErr_SetRaisedException(Py_NewRef(exc));
            return PYGEN_ERROR;
        }
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError,
                            "can't send non-None value to a just-started coroutine");
            return PYGEN_ERROR;
        }
    }
    self->running = 1;
    PySendResult r = self->state == EXT_CORO_CREATED ? self->kind->start(self, result)
                                                     : self->kind->resume(self, arg, exc, result);
    self->running = 0;
    if (r == PYGEN_ERROR) *result = NULL;
    return r;
}

PySendResult ext_coro_am_send(PyObject *self, PyObject *arg, PyObject **result) {
    return ext_coro_step((ext_coro *)self, arg, NULL, result);
}

/* The outcome of a step as a call's: a yielded value, or StopIteration. */
PyObject *ext_step_as_call(ext_state *st, PySendResult r, PyObject *result) {
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_RETURN) {
        ext_raise_stop_iteration(&st->compat, result);
        Py_DECREF(result);
    }
    return NULL;
}

PyObject *ext_coro_iternext(PyObject *self) {
    PyObject *result;
    PySendResult r = ext_coro_step((ext_coro *)self, Py_None, NULL, &result);
    if (r == PYGEN_RETURN && result == Py_None) { /* StopIteration(None), unraised */
        Py_DECREF(result);
        return NULL;
    }
    return ext_step_as_call(((ext_coro *)self)->st, r, result);
}

static PyObject *coro_send(PyObject *self, PyObject *arg) {
    PyObject *result;
    PySendResult r = ext_coro_step((ext_coro *)self, arg, NULL, &result);
    return ext_step_as_call(((ext_coro *)self)->st, r, result);
}

/* throw(exc) or the older throw(type[, value[, traceback]]) */
static PyObject *coro_throw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *exc = ext_throw_args_exception(args, nargs);
    if (!exc) return NULL;
    PyObject *result;
    PySendResult r = ext_coro_step((ext_coro *)self, NULL, exc, &result);
    Py_DECREF(exc);
    return ext_step_as_call(((ext_coro *)self)->st, r, result);
}

/* close(): GeneratorExit at the suspension point (ext_throw_into closes
 * what is awaited first, as a coroutine's close() does). */
static PyObject *coro_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
    ext_coro *self = (ext_coro *)op;
    if (self->state == EXT_CORO_CREATED) {
        self->state = EXT_CORO_CLOSED;
        self->kind->discard(self);
        Py_RETURN_NONE;
    }
    if (self->state == EXT_CORO_CLOSED) Py_RETURN_NONE;
    PyObject *exc = PyObject_CallNoArgs(PyExc_GeneratorExit);
    if (!exc) return NULL;
    PyObject *result;
    PySendResult r = ext_coro_step(self, NULL, exc, &result);
    Py_DECREF(exc);
    if (r == PYGEN_NEXT) {
        Py_DECREF(result);
        PyErr_SetString(PyExc_RuntimeError, "coroutine ignored GeneratorExit");
        return NULL;
    }
    if (r == PYGEN_RETURN) {
#if PY_VERSION_HEX >= 0x030D0000
        return result; /* 3.13: close() returns what the coroutine returned */
#else
        Py_DECREF(result);
        Py_RETURN_NONE;
#endif
    }
    if (PyErr_ExceptionMatches(PyExc_GeneratorExit) ||
        PyErr_ExceptionMatches(PyExc_StopIteration)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return NULL;
}

/* Like a coroutine's: close() if suspended; "never awaited" if never started. */
void ext_coro_finalize(PyObject *op) {
    ext_coro *self = (ext_coro *)op;
    if (self->state == EXT_CORO_CLOSED) return;
    PyObject *exc = PyErr_GetRaisedException();
    if (self->state == EXT_CORO_CREATED) {
        /* closed before the warning, whose filters and hooks are Python
         * code that may find it and try to start it */
        self->state = EXT_CORO_CLOSED;
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "coroutine '%s' was never awaited",
                             self->kind->name) < 0)
            PyErr_WriteUnraisable(op);
        self->kind->discard(self);
    } else {
        PyObject *r = coro_close(op, NULL);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable(op);
    }
    PyErr_SetRaisedException(exc);
}

PyObject *ext_coro_self_await(PyObject *self) { return Py_NewRef(self); }

static PyObject *coro_get_await(PyObject *op, void *Py_UNUSED(c)) {
    ext_coro *self = (ext_coro *)op;
    PyObject *inner = self->state == EXT_CORO_SUSPENDED ? self->kind->awaiting(self) : NULL;
    return Py_NewRef(inner ? inner : Py_None);
}

static PyObject *coro_get_running(PyObject *op, void *Py_UNUSED(c)) {
    return PyBool_FromLong(((ext_coro *)op)->running);
}

static PyObject *coro_get_suspended(PyObject *op, void *Py_UNUSED(c)) {
    ext_coro *self = (ext_coro *)op;
    return PyBool_FromLong(self->state == EXT_CORO_SUSPENDED && !self->running);
}

static PyObject *coro_get_none(PyObject *Py_UNUSED(self), void *Py_UNUSED(c)) {
    Py_RETURN_NONE;
}

/* A C coroutine has no frame of its own, but inspect.getcoroutinestate() of
 * 3.11-3.14 tells one not yet started (CORO_CREATED) from an ended one
 * (CORO_CLOSED) by its cr_frame alone, and what reads a cr_frame expects a
 * frame or None.  So until the first send, cr_frame is a frame where the
 * coroutine would start: an empty code object named for it, in this
 * module's globals; a new one each time (it is only ever inspected).  Once
 * started, None, as before (cr_running and cr_suspended then tell). */
static PyObject *coro_get_frame(PyObject *op, void *Py_UNUSED(c)) {
    ext_coro *self = (ext_coro *)op;
    if (self->state != EXT_CORO_CREATED || self->running) Py_RETURN_NONE;
    PyObject *m = PyType_GetModuleByDef(Py_TYPE(op), &ext_module_def);
    if (!m) return NULL;
    PyCodeObject *code = PyCode_NewEmpty("<bucketimer._core>", self->kind->name, 0);
    if (!code) return NULL;
    PyFrameObject *f = PyFrame_New(PyThreadState_Get(), code, PyModule_GetDict(m), NULL);
    Py_DECREF(code);
    return (PyObject *)f;
}

#if PY_VERSION_HEX >= 0x030F0000
/* 3.15's coroutines say their state, and its inspect.getcoroutinestate()
 * reads only that. */
static PyObject *coro_get_state(PyObject *op, void *Py_UNUSED(c)) {
    ext_coro *self = (ext_coro *)op;
    const char *name = self->running                          ? "CORO_RUNNING"
                       : self->state == EXT_CORO_CREATED   ? "CORO_CREATED"
                       : self->state == EXT_CORO_SUSPENDED ? "CORO_SUSPENDED"
                                                           : "CORO_CLOSED";
    return PyUnicode_InternFromString(name);
}
#endif

static PyObject *coro_get_name(PyObject *op, void *Py_UNUSED(c)) {
    return PyUnicode_FromString(((ext_coro *)op)->kind->name);
}

PyMethodDef ext_coro_methods[] = {
    {"send", (PyCFunction)coro_send, METH_O,
     "send(arg) -> send 'arg' into coroutine,\nreturn next iterated value or raise StopIteration."},
    {"throw", (PyCFunction)(void (*)(void))coro_throw, METH_FASTCALL,
     "throw(value)\nthrow(type[,value[,traceback]])\n\nRaise exception in coroutine, return next "
     "iterated value or raise StopIteration."},
    {"close", (PyCFunction)coro_close, METH_NOARGS, "close() -> raise GeneratorExit inside coroutine."},
    {NULL}};

PyGetSetDef ext_coro_getset[] = {
    {"cr_await", coro_get_await, NULL, "object being awaited on, or None", NULL},
    {"cr_running", coro_get_running, NULL, NULL, NULL},
    {"cr_suspended", coro_get_suspended, NULL, NULL, NULL},
    {"cr_frame", coro_get_frame, NULL,
     "Until the first send, a frame where it would start; then None (it has no frame)", NULL},
#if PY_VERSION_HEX >= 0x030F0000
    {"cr_state", coro_get_state, NULL, NULL, NULL},
#endif
    {"cr_code", coro_get_none, NULL, "None: this coroutine has no code object", NULL},
    {"__name__", coro_get_name, NULL, NULL, NULL},
    {"__qualname__", coro_get_name, NULL, NULL, NULL},
    {NULL}};

/* ---- WaitFor, the type -------------------------------------------------- */

static PyObject *WaitFor_repr(WaitForObject *self) {
    return PyUnicode_FromFormat("<bucketimer wait_for coroutine object at %p>", self);
}

static PyType_Slot WaitFor_slots[] = {
    {Py_tp_doc, "The coroutine bucketimer.wait_for() returns (3.12 and later)."},
    {Py_tp_dealloc, WaitFor_dealloc},
    {Py_tp_traverse, WaitFor_traverse},
    {Py_tp_clear, WaitFor_clear},
    {Py_tp_repr, WaitFor_repr},
    EXT_CORO_SLOTS,
    {0, NULL}};

PyType_Spec WaitFor_spec = {
    .name = "bucketimer._core.WaitFor",
    .basicsize = sizeof(WaitForObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = WaitFor_slots,
};

PyObject *ext_wait_for(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"fut", "timeout"};
    PyObject *vals[2] = {NULL, NULL};
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "wait_for() takes 2 positional arguments but %zd were given",
                     nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) vals[i] = args[i];
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        int j = PyUnicode_CompareWithASCIIString(k, "fut") == 0       ? 0
                : PyUnicode_CompareWithASCIIString(k, "timeout") == 0 ? 1
                                                                      : -1;
        if (j < 0) {
            PyErr_Format(PyExc_TypeError, "wait_for() got an unexpected keyword argument %R", k);
            return NULL;
        }
        if (vals[j]) {
            PyErr_Format(PyExc_TypeError, "wait_for() got multiple values for argument '%s'",
                         names[j]);
            return NULL;
        }
        vals[j] = args[nargs + i];
    }
    for (int j = 0; j < 2; j++)
        if (!vals[j]) {
            PyErr_Format(PyExc_TypeError, "wait_for() missing required argument: '%s'", names[j]);
            return NULL;
        }
    ext_state *st = ext_state_of_module(m);
    WaitForObject *self = PyObject_GC_New(WaitForObject, st->WaitFor_Type);
    if (!self) return NULL;
    self->co.kind = &waitfor_kind;
    self->co.st = st;
    self->co.state = EXT_CORO_CREATED;
    self->co.running = 0;
    self->fut = Py_NewRef(vals[0]);
    self->delay = Py_NewRef(vals[1]);
    self->inner = self->timeout = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

PyObject *ext_set_wait_for_nonpositive(PyObject *m, PyObject *fn) {
    Py_XSETREF(ext_state_of_module(m)->wait_for_nonpositive, Py_NewRef(fn));
    Py_RETURN_NONE;
}

#endif /* 3.12 and later */
