/*
 * compat.c -- bucketimer._core's reads of CPython-private state, each with
 * its version gate, its self-check and its public-API twin (compat.h states
 * the rules).  The only file of the module that sees CPython's internal
 * headers: it takes the thread state's field offsets from them instead of
 * hard-coding them.
 */
/* Core mode (for pycore_tstate.h) only on the versions whose thread-state
 * layout was checked: the version and the build's flags are known before
 * Python.h decides what it declares. */
#include <patchlevel.h>
#include <pyconfig.h>
#if !defined(Py_GIL_DISABLED) && PY_VERSION_HEX >= 0x030D0000 && PY_VERSION_HEX < 0x03100000
#define Py_BUILD_CORE_MODULE 1
#endif
#include <Python.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "compat.h"

/* ---- gates: the versions each read was checked on, and pays on ----------
 * docs/design.rst gives what each saves.  Free-threaded builds were never
 * checked: they take the public API, as does any version after 3.15. */

#if !defined(Py_GIL_DISABLED) && PY_VERSION_HEX < 0x03100000
#if defined(Py_BUILD_CORE_MODULE) && defined(__has_include)
#if __has_include("internal/pycore_tstate.h")
#include "internal/pycore_tstate.h"
#define HAVE_TSTATE_IMPL 1
#endif
#if __has_include("internal/pycore_object.h")
#include "internal/pycore_object.h" /* _PyObject_GetMethod, 3.13-3.15 */
#define HAVE_GET_METHOD_DECL 1
#endif
#endif

#if PY_VERSION_HEX < 0x030C0000
#define LOOP_READ_HOLDER 1 /* 3.11: saves a getpid() call */
#elif defined(HAVE_TSTATE_IMPL)
#define LOOP_READ_TSTATE 1 /* 3.13-3.15; 3.12's own lookup is as cheap as a read */
#endif

#if PY_VERSION_HEX < 0x030E0000
#define TASK_READ_DICT 1 /* 3.11-3.13 */
#elif defined(HAVE_TSTATE_IMPL)
#define TASK_READ_TSTATE 1 /* 3.14, 3.15 */
#endif

#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030F0000
#define STOP_ITERATION_REUSE 1 /* 3.12-3.14: 3.15's `await` makes none to save */
#endif

#if PY_VERSION_HEX >= 0x030C0000
#define CR_AWAIT_GETTER 1 /* 3.12-3.15, where wait_for is written in C */
#endif

#if PY_VERSION_HEX < 0x030D0000 || defined(HAVE_GET_METHOD_DECL)
#define TIME_GET_METHOD 1 /* 3.11-3.15: in cpython/object.h, then internal */
#endif
#endif

#define LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)
#define STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)

/* The self-check of a read whose state is EXT_READ_UNPROVEN.  `rc` and
 * `mine` are what the read gave (rc 0: an answer; 1: it cannot tell),
 * `theirs` is the public API's answer.  Agreeing on None proves nothing (a
 * word nobody writes reads as None too), so a read is proven by agreeing on
 * anything else; disagreeing turns it off for good. */
static void judge(_Atomic int *state, int rc, PyObject *mine, PyObject *theirs) {
    if (rc != 0) return;
    if (mine != theirs) STORE(*state, EXT_READ_OFF_MISMATCH);
    else if (theirs != Py_None) STORE(*state, EXT_READ_PROVEN);
}

/* A read's answer for `arg`: the private read's once it is proven (and can
 * tell), else the public twin's, which an unproven read is judged against.
 * `read` gives a borrowed reference (0) or cannot tell (1); `ask`, the
 * public API, a new one.  Inlined with each caller's two functions. */
typedef int (*read_fn)(ext_compat *c, PyObject *arg, PyObject **out);
typedef PyObject *(*ask_fn)(ext_compat *c, PyObject *arg);
static inline __attribute__((always_inline)) PyObject *answer(ext_compat *c, _Atomic int *state,
                                                              PyObject *arg, read_fn read,
                                                              ask_fn ask) {
    int s = LOAD(*state);
    PyObject *mine = NULL;
    if (s == EXT_READ_PROVEN && read(c, arg, &mine) == 0) return Py_NewRef(mine);
    PyObject *theirs = ask(c, arg);
    if (theirs && s == EXT_READ_UNPROVEN) {
        int rc = read(c, arg, &mine);
        judge(state, rc, mine, theirs);
    }
    return theirs;
}

/* ---- the running loop ------------------------------------------------------
 * asyncio._get_running_loop() on 3.11 calls getpid() (a syscall) to hide a
 * parent's loop from a forked child; that was a third of a schedule+cancel
 * pair.  3.11 keeps a holder (loop, pid) in the thread-state dict: we read
 * it and compare its pid with one cached and refreshed after fork().  3.13
 * moved the loop into the thread state (_PyThreadStateImpl.
 * asyncio_running_loop), where it is a load instead of a call. */

#if defined(LOOP_READ_HOLDER)
#include <unistd.h>
typedef struct {
    PyObject_HEAD
    PyObject *rl_loop;
    pid_t rl_pid;
} running_loop_holder; /* _asynciomodule.c, 3.11 */

static _Atomic pid_t cached_pid;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;
static void refresh_pid(void) { atomic_store(&cached_pid, getpid()); }
static void install_pid_cache(void) {
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}

/* The holder's type, recognised by name and size the first time one is
 * seen; a holder of any other type cannot be read. */
static int is_holder(ext_compat *c, PyObject *v) {
    PyTypeObject *tp = Py_TYPE(v);
    if (!c->holder_type && strstr(tp->tp_name, "_RunningLoopHolder") != NULL &&
        tp->tp_basicsize == sizeof(running_loop_holder))
        c->holder_type = (PyTypeObject *)Py_NewRef(tp);
    return tp == c->holder_type;
}
#endif

/* This thread's running loop as the private state holds it (borrowed, or
 * Py_None): 0, or 1 if the read cannot tell. */
static inline __attribute__((always_inline)) int read_running_loop(ext_compat *c,
                                                                   PyObject *unused,
                                                                   PyObject **out) {
    (void)unused;
#if defined(LOOP_READ_TSTATE)
    (void)c;
    PyObject *loop = ((_PyThreadStateImpl *)PyThreadState_Get())->asyncio_running_loop;
    *out = loop ? loop : Py_None;
    return 0;
#elif defined(LOOP_READ_HOLDER)
    PyObject *d = PyThreadState_GetDict();
    if (!d) return 1;
    PyObject *v = PyDict_GetItemWithError(d, c->running_loop_key);
    if (!v) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        *out = Py_None;
        return 0;
    }
    if (!is_holder(c, v)) return 1;
    running_loop_holder *h = (running_loop_holder *)v;
    *out = h->rl_pid == atomic_load_explicit(&cached_pid, memory_order_relaxed) ? h->rl_loop
                                                                                : Py_None;
    return 0;
#else
    (void)c;
    (void)out;
    return 1;
#endif
}

static PyObject *ask_running_loop(ext_compat *c, PyObject *unused) {
    (void)unused;
    return PyObject_CallNoArgs(c->get_running_loop);
}

PyObject *ext_running_loop(ext_compat *c) {
    return answer(c, &c->running_loop_read, NULL, read_running_loop, ask_running_loop);
}

/* ---- the current task ------------------------------------------------------
 * asyncio.current_task(loop) up to 3.13 looks `loop` up in _asyncio's
 * loop -> task dict (asyncio.tasks._current_tasks); we look it up without
 * the call.  3.14 moved the running task into the thread state, next to the
 * running loop, and stopped writing that dict. */

/* The current task of `loop` as the private state holds it (borrowed, or
 * Py_None): 0, or 1 if the read cannot tell. */
static inline __attribute__((always_inline)) int read_current_task(ext_compat *c,
                                                                   PyObject *loop,
                                                                   PyObject **out) {
#if defined(TASK_READ_TSTATE)
    (void)c;
    _PyThreadStateImpl *ts = (_PyThreadStateImpl *)PyThreadState_Get();
    if (ts->asyncio_running_loop != loop) return 1; /* another thread's loop */
    *out = ts->asyncio_running_task ? ts->asyncio_running_task : Py_None;
    return 0;
#elif defined(TASK_READ_DICT)
    if (!c->current_tasks) return 1;
    PyObject *task = PyDict_GetItemWithError(c->current_tasks, loop);
    if (!task && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    *out = task ? task : Py_None;
    return 0;
#else
    (void)c;
    (void)loop;
    (void)out;
    return 1;
#endif
}

static PyObject *ask_current_task(ext_compat *c, PyObject *loop) {
    return PyObject_CallOneArg(c->current_task, loop);
}

PyObject *ext_current_task(ext_compat *c, PyObject *loop) {
    return answer(c, &c->current_task_read, loop, read_current_task, ask_current_task);
}

/* ---- a StopIteration raised again and again ----------------------------------
 * From 3.12 the interpreter's SEND asks an awaitable that is not a
 * generator for its next value through tp_iternext, and takes `return
 * value` out of a StopIteration.  Making that exception (its args tuple,
 * __init__, the context bookkeeping of PyErr_SetObject) was a sixth of an
 * `async with timeout()`.  So one instance is kept and raised again as long
 * as nobody else holds it or its args and it picked up no traceback,
 * context, cause, notes or other attributes: SEND reads `value` and lets go of it at once, so
 * it is ours alone again before the next raise.  Its args tuple, ours alone
 * too, is refilled in place, so whoever catches it sees what
 * StopIteration(value) shows.  Whoever keeps it (a debugger,
 * sys.monitoring, `except StopIteration as e`) keeps it unchanged: a new
 * one is made.  The check: the exception struct's fields are what the
 * public accessors say they are. */

#if defined(STOP_ITERATION_REUSE)
/* 1 if the fields of a StopIteration are where this build expects them:
 * set through the public API, seen in the struct. */
static int stop_iteration_layout_ok(void) {
    int ok = 0;
    PyObject *v = PyList_New(0), *ctx = PyList_New(0), *notes = PyList_New(0);
    PyObject *e = v ? PyObject_CallOneArg(PyExc_StopIteration, v) : NULL;
    PyObject *args = e ? PyObject_GetAttrString(e, "args") : NULL;
    PyObject *value = e ? PyObject_GetAttrString(e, "value") : NULL;
    if (args && value && ctx && notes) {
        PyBaseExceptionObject *b = (PyBaseExceptionObject *)e;
        ok = ((PyStopIterationObject *)e)->value == v && value == v && b->args == args &&
             PyTuple_CheckExact(args) && PyTuple_GET_SIZE(args) == 1 &&
             PyTuple_GET_ITEM(args, 0) == v && !b->traceback && !b->context && !b->cause &&
             !b->dict && !b->suppress_context;
        PyException_SetContext(e, Py_NewRef(ctx));
        PyException_SetCause(e, Py_NewRef(v));
        /* notes (and any other attribute) live in the instance dict */
        ok = ok && b->context == ctx && b->cause == v && b->suppress_context &&
             PyObject_SetAttrString(e, "__notes__", notes) == 0 && b->dict &&
             PyDict_CheckExact(b->dict) && PyDict_GetItemString(b->dict, "__notes__") == notes;
    }
    Py_XDECREF(args);
    Py_XDECREF(value);
    Py_XDECREF(e);
    Py_XDECREF(v);
    Py_XDECREF(ctx);
    Py_XDECREF(notes);
    PyErr_Clear();
    return ok;
}

/* 1 if the kept instance can be raised again for a new value. */
static int reusable(PyObject *e) {
    PyBaseExceptionObject *b = (PyBaseExceptionObject *)e;
    return Py_REFCNT(e) == 1 && !b->traceback && !b->context && !b->cause && !b->dict &&
           !b->suppress_context && b->args && PyTuple_CheckExact(b->args) &&
           Py_REFCNT(b->args) == 1 && PyTuple_GET_SIZE(b->args) == 1 &&
           Py_IS_TYPE(e, (PyTypeObject *)PyExc_StopIteration);
}
#endif

PyObject *ext_raise_stop_iteration(ext_compat *c, PyObject *value) {
#if defined(STOP_ITERATION_REUSE)
    PyObject *e = c->stop_iteration;
    if (e && reusable(e)) {
        /* The values it held are let go of last: their __del__ may raise
         * another StopIteration here, which finds this one taken (ours by
         * the reference held) and makes its own. */
        Py_INCREF(e);
        PyBaseExceptionObject *b = (PyBaseExceptionObject *)e;
        PyObject *old_arg = PyTuple_GET_ITEM(b->args, 0);
        PyObject *old_value = ((PyStopIterationObject *)e)->value;
        PyTuple_SET_ITEM(b->args, 0, Py_NewRef(value));
        ((PyStopIterationObject *)e)->value = Py_NewRef(value);
        Py_DECREF(old_arg);
        Py_XDECREF(old_value);
        PyErr_SetRaisedException(e);
        return NULL;
    }
    Py_CLEAR(c->stop_iteration);
#else
    (void)c;
#endif
    PyObject *n = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (!n) return NULL;
#if defined(STOP_ITERATION_REUSE)
    if (LOAD(c->stop_iteration_read) == EXT_READ_PROVEN) c->stop_iteration = Py_NewRef(n);
#endif
    PyErr_SetRaisedException(n);
    return NULL;
}

void ext_release_stop_iteration(ext_compat *c) {
#if defined(STOP_ITERATION_REUSE)
    PyObject *e = c->stop_iteration;
    if (e && Py_REFCNT(e) == 1 && ((PyStopIterationObject *)e)->value != Py_None)
        ext_forget_stop_iteration(c, ((PyStopIterationObject *)e)->value);
#else
    (void)c;
#endif
}

void ext_forget_stop_iteration(ext_compat *c, PyObject *value) {
#if defined(STOP_ITERATION_REUSE)
    PyObject *e = c->stop_iteration;
    if (!e || Py_REFCNT(e) != 1 || ((PyStopIterationObject *)e)->value != value) return;
    PyObject *args = ((PyBaseExceptionObject *)e)->args;
    if (args && PyTuple_CheckExact(args) && Py_REFCNT(args) == 1 &&
        PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == value) {
        PyTuple_SET_ITEM(args, 0, Py_NewRef(Py_None));
        Py_DECREF(value);
        Py_SETREF(((PyStopIterationObject *)e)->value, Py_NewRef(Py_None));
    } else {
        Py_CLEAR(c->stop_iteration);
    }
#else
    (void)c;
    (void)value;
#endif
}

/* ---- cr_await of a coroutine ----------------------------------------------
 * wait_for() asks whether the coroutine it is given is already being
 * awaited.  The coroutine type's own getter answers without the attribute
 * lookup; the check: the type's cr_await descriptor is that getter. */

#if defined(CR_AWAIT_GETTER)
static getter find_cr_await_getter(void) {
    getter g = NULL;
    for (PyGetSetDef *d = PyCoro_Type.tp_getset; d && d->name; d++)
        if (strcmp(d->name, "cr_await") == 0 && !d->closure) g = d->get;
    PyObject *descr = PyObject_GetAttrString((PyObject *)&PyCoro_Type, "cr_await");
    if (!descr) {
        PyErr_Clear();
        return NULL;
    }
    int same = Py_IS_TYPE(descr, &PyGetSetDescr_Type) &&
               ((PyGetSetDescrObject *)descr)->d_getset->get == g;
    Py_DECREF(descr);
    return same ? g : NULL;
}
#endif

PyObject *ext_coro_await(ext_compat *c, PyObject *coro) {
    if (LOAD(c->cr_await_read) == EXT_READ_PROVEN) return c->cr_await_getter(coro, NULL);
    return PyObject_GetAttr(coro, c->str_cr_await);
}

/* ---- the function behind loop.time -----------------------------------------
 * The helpers read the core's clock themselves unless the loop's `time` is
 * not a clock they know, on its class or set on the instance
 * (mock.patch.object(loop, "time")).  The public way to see the instance's
 * side, loop.time, binds a method: an allocation, a tenth of an `async
 * with timeout()`.  (Reading the instance's __dict__ instead is cheap but
 * costs every later loop iteration: on 3.11, 3.12, 3.14 and 3.15 it ends
 * the inline attribute values that the interpreter's attribute reads on the
 * loop are specialised for.)  _PyObject_GetMethod, what the interpreter
 * uses for `loop.time()`, returns the class's function unbound when nothing
 * on the instance shadows it.  The check: the same function as the bound
 * method's. */

/* The function loop.time binds to `loop` (borrowed: the class holds it):
 * 0, or 1 if the read cannot tell (the attribute is not a method of the
 * class, or is set on the instance: the public API answers those). */
static inline __attribute__((always_inline)) int read_time_function(ext_compat *c,
                                                                    PyObject *loop,
                                                                    PyObject **out) {
#if defined(TIME_GET_METHOD)
    PyObject *m = NULL;
    int unbound = _PyObject_GetMethod(loop, c->str_time, &m);
    if (!m) {
        PyErr_Clear();
        return 1;
    }
    Py_DECREF(m); /* the class's dict (or the instance's) keeps it */
    if (!unbound) return 1;
    *out = m;
    return 0;
#else
    (void)c;
    (void)loop;
    (void)out;
    return 1;
#endif
}

/* The public twin: loop.time's __func__ if it is a method bound to loop. */
static PyObject *ask_time_function(ext_compat *c, PyObject *loop) {
    PyObject *b = PyObject_GetAttr(loop, c->str_time);
    if (!b) return NULL;
    PyObject *f = PyMethod_Check(b) && PyMethod_GET_SELF(b) == loop ? PyMethod_GET_FUNCTION(b)
                                                                    : Py_None;
    Py_INCREF(f);
    Py_DECREF(b);
    return f;
}

PyObject *ext_loop_time_function(ext_compat *c, PyObject *loop) {
    return answer(c, &c->loop_time_read, loop, read_time_function, ask_time_function);
}

/* ---- set-up ------------------------------------------------------------------ */

/* Whether BUCKETIMER_PUBLIC_API turns the read `name` off: "1" (or any
 * value but "0") turns every read off, a comma-separated list of read names
 * just those (to measure what each one saves). */
static int public_api_forced(const char *name) {
    const char *v = getenv("BUCKETIMER_PUBLIC_API");
    if (!v || !*v || strcmp(v, "0") == 0) return 0;
    if (!strchr(v, '_')) return 1; /* no read name in it */
    size_t n = strlen(name);
    for (const char *p = strstr(v, name); p; p = strstr(p + 1, name))
        if ((p == v || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return 1;
    return 0;
}

PyObject *ext_import_attr(const char *module, const char *name) {
    PyObject *m = PyImport_ImportModule(module);
    if (!m) return NULL;
    PyObject *a = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return a;
}

/* The state a read starts in; `gated_in` says whether this build has it. */
static void start(_Atomic int *state, const char *name, int gated_in, int start_as) {
    atomic_init(state, !gated_in                 ? EXT_READ_OFF_VERSION
                       : public_api_forced(name) ? EXT_READ_OFF_ENV
                                                 : start_as);
}

int ext_compat_init(ext_compat *c) {
    c->get_running_loop = ext_import_attr("asyncio.events", "_get_running_loop");
    if (!c->get_running_loop) return -1;
    c->current_task = ext_import_attr("asyncio.tasks", "current_task");
    if (!c->current_task) return -1;
    c->str_cr_await = PyUnicode_InternFromString("cr_await");
    if (!c->str_cr_await) return -1;
    c->str_time = PyUnicode_InternFromString("time");
    if (!c->str_time) return -1;

    int loop_in = 0, task_in = 0, stop_in = 0, await_in = 0, stop_ok = 0, time_in = 0;
#if defined(LOOP_READ_HOLDER) || defined(LOOP_READ_TSTATE)
    loop_in = 1;
#endif
#if defined(LOOP_READ_HOLDER)
    pthread_once(&pid_once, install_pid_cache);
    c->running_loop_key = PyUnicode_InternFromString("__asyncio_running_event_loop__");
    if (!c->running_loop_key) return -1;
#endif
#if defined(TASK_READ_DICT)
    /* _asyncio's dict, which asyncio.tasks re-exports; anything else
     * (the pure-Python fallback's dict, say) is not read. */
    PyObject *ct = ext_import_attr("_asyncio", "_current_tasks");
    if (ct && PyDict_CheckExact(ct)) c->current_tasks = ct;
    else Py_XDECREF(ct);
    PyErr_Clear();
    task_in = c->current_tasks != NULL;
#elif defined(TASK_READ_TSTATE)
    task_in = 1;
#endif
#if defined(STOP_ITERATION_REUSE)
    stop_in = 1;
    stop_ok = stop_iteration_layout_ok();
#endif
#if defined(CR_AWAIT_GETTER)
    c->cr_await_getter = find_cr_await_getter();
    await_in = c->cr_await_getter != NULL;
#endif
#if defined(TIME_GET_METHOD)
    time_in = 1;
#endif
    start(&c->running_loop_read, "running_loop", loop_in, EXT_READ_UNPROVEN);
    start(&c->current_task_read, "current_task", task_in, EXT_READ_UNPROVEN);
    start(&c->stop_iteration_read, "stop_iteration", stop_in,
          stop_ok ? EXT_READ_PROVEN : EXT_READ_OFF_MISMATCH);
    start(&c->cr_await_read, "cr_await", await_in, EXT_READ_PROVEN);
    start(&c->loop_time_read, "loop_time", time_in, EXT_READ_UNPROVEN);
    return 0;
}

int ext_compat_traverse(ext_compat *c, visitproc visit, void *arg) {
    Py_VISIT(c->get_running_loop);
    Py_VISIT(c->current_task);
    Py_VISIT(c->holder_type);
    Py_VISIT(c->current_tasks);
    Py_VISIT(c->stop_iteration);
    return 0;
}

void ext_compat_clear(ext_compat *c) {
    Py_CLEAR(c->get_running_loop);
    Py_CLEAR(c->current_task);
    Py_CLEAR(c->str_cr_await);
    Py_CLEAR(c->str_time);
    Py_CLEAR(c->running_loop_key);
    Py_CLEAR(c->holder_type);
    Py_CLEAR(c->current_tasks);
    Py_CLEAR(c->stop_iteration);
}

static const char *state_name(int s) {
    switch (s) {
    case EXT_READ_PROVEN: return "private";
    case EXT_READ_UNPROVEN: return "unproven";
    case EXT_READ_OFF_MISMATCH: return "public: disagreed with the public API";
    case EXT_READ_OFF_ENV: return "public: BUCKETIMER_PUBLIC_API";
    default: return "public: not available on this CPython build";
    }
}

PyObject *ext_compat_status(ext_compat *c) {
    return Py_BuildValue("{ssssssssss}", "running_loop", state_name(LOAD(c->running_loop_read)),
                         "current_task", state_name(LOAD(c->current_task_read)),
                         "stop_iteration", state_name(LOAD(c->stop_iteration_read)),
                         "cr_await", state_name(LOAD(c->cr_await_read)),
                         "loop_time", state_name(LOAD(c->loop_time_read)));
}
