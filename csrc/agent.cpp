// kvdiag.agent._dumper: the in-process half of capture without ptrace.
//
// Contract of this file:
//   Locks:   none. Cross-thread state is a handful of std::atomic<int> words and per-thread slots in
//            static storage; one dump at a time (g_busy), any other request is dropped.
//   GIL:     never taken, never released, never waited for. prepare()/install()/rearm_child()/disarm()
//            run at arm time with the GIL held, as any Python call. The signal handlers run in
//            whatever state the interrupted thread was in: each one asks the runtime from its own
//            thread whether that thread holds the GIL (PyGILState_Check: a TSS read and a compare with
//            the runtime's current thread state, no lock) and whether it has a thread state at all.
//   Memory:  nothing is allocated in a handler. Slots, the thread list and every buffer are static;
//            backtrace() is primed in prepare() so that libgcc's unwinder is loaded before any dump.
//   Python:  the Python stacks are written by faulthandler's own handler for the trigger signal
//            (registered by kvdiag.agent.arm with all_threads=True), called from ours with its file
//            descriptor pointed at the dump file for the duration of the call. faulthandler reads the
//            interpreter's thread list without the GIL; the other threads are parked in our per-thread
//            handler meanwhile, so their frames do not change under it.
//   Waits:   the trigger handler waits at most kCollectMs for the other threads to answer; a thread
//            parks in its handler at most kParkMs until the trigger handler releases it. A thread that
//            sleeps uninterruptibly or is gone is written as "noanswer"; one that blocks the thread signal
//            (its SigBlk, read from /proc/self/task/TID/status) is not signalled and written as "blocked";
//            nor is one asleep in nanosleep/clock_nanosleep, or resuming such a sleep after a stop ("asleep":
//            a handler would end its sleep early).
//            The interpreter's thread-state list (read as faulthandler reads it) names their Python stacks.
//   Signals: two real-time signals picked at arm time among those with no handler. Requests are honoured
//            only from sigqueue(2) by the same uid (or root) naming an existing request file in the
//            agent's private directory (0700, owned by us); the dump is written beside it and renamed
//            into place when complete.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <tuple>
#include <ucontext.h>
#include <unistd.h>

namespace nb = nanobind;

namespace {

constexpr int kMaxSlots = 1024;
constexpr int kMaxFrames = 96;
constexpr long kCollectMs = 300;
constexpr long kParkMs = 1500;

enum SlotState : int { kPending = 1, kDone = 2, kBlocked = 3, kAsleep = 4 };

struct Slot {
    std::atomic<int> tid{0};
    std::atomic<int> state{0};
    std::atomic<int> gen{0};
    unsigned long pthread_id = 0;
    int holds_gil = -1;
    int has_tstate = -1;
    int nframes = 0;
    uintptr_t pc = 0;
    void* frames[kMaxFrames];
};

Slot g_slots[kMaxSlots];
int g_tids[kMaxSlots];
std::atomic<int> g_nslots{0};
std::atomic<int> g_busy{0};
std::atomic<int> g_active{0};     // generation of the dump in progress, 0: none
std::atomic<int> g_release{0};    // generation whose parked threads may go
std::atomic<int> g_disarmed{0};
std::atomic<int> g_inside{0};     // threads still inside thread_handler (a late one from the last dump)
std::atomic<unsigned> g_dumps{0};
int g_gen = 0;

int g_dirfd = -1;
int g_placeholder = -1;           // the fd faulthandler writes to; /dev/null between dumps
int g_devnull = -1;
int g_trigger = 0;
int g_thread = 0;
pid_t g_pid = 0;
uid_t g_uid = 0;
struct sigaction g_fault_prev;    // faulthandler's handler for the trigger signal
bool g_have_fault = false;

char g_line[4096];
char g_dents[8192];
char g_copy[16384];

pid_t sys_gettid() { return static_cast<pid_t>(syscall(SYS_gettid)); }

// --- async-signal-safe formatting into g_line -----------------------------------------------------

struct Out {
    int fd;
    size_t len = 0;
    void flush() {
        size_t off = 0;
        while (off < len) {
            ssize_t w = write(fd, g_line + off, len - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            off += static_cast<size_t>(w);
        }
        len = 0;
    }
    void room(size_t n) {
        if (len + n > sizeof(g_line)) flush();
    }
    Out& s(const char* text) {
        size_t n = strlen(text);
        room(n);
        if (n > sizeof(g_line)) n = sizeof(g_line);
        memcpy(g_line + len, text, n);
        len += n;
        return *this;
    }
    Out& u(unsigned long long v) {
        char tmp[24];
        int i = 0;
        do { tmp[i++] = static_cast<char>('0' + v % 10); v /= 10; } while (v && i < 24);
        room(static_cast<size_t>(i));
        while (i) g_line[len++] = tmp[--i];
        return *this;
    }
    Out& i(long long v) {
        if (v < 0) { s("-"); return u(static_cast<unsigned long long>(-v)); }
        return u(static_cast<unsigned long long>(v));
    }
    Out& x(unsigned long long v) {
        char tmp[20];
        int k = 0;
        do { tmp[k++] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v && k < 20);
        room(static_cast<size_t>(k) + 2);
        g_line[len++] = '0';
        g_line[len++] = 'x';
        while (k) g_line[len++] = tmp[--k];
        return *this;
    }
};

// "PID.NONCE.ext" into buf (no allocation, no stdio).
void name_of(char* buf, size_t cap, unsigned nonce, const char* ext) {
    char tmp[64];
    size_t n = 0;
    auto put_u = [&](unsigned long long v) {
        char d[24];
        int k = 0;
        do { d[k++] = static_cast<char>('0' + v % 10); v /= 10; } while (v && k < 24);
        while (k && n + 1 < sizeof(tmp)) tmp[n++] = d[--k];
    };
    put_u(static_cast<unsigned long long>(g_pid));
    tmp[n++] = '.';
    put_u(nonce);
    tmp[n++] = '.';
    for (const char* e = ext; *e && n + 1 < sizeof(tmp); ++e) tmp[n++] = *e;
    tmp[n] = '\0';
    size_t m = n < cap - 1 ? n : cap - 1;
    memcpy(buf, tmp, m);
    buf[m] = '\0';
}

void sleep_us(long us) {
    struct timespec ts{0, us * 1000};
    nanosleep(&ts, nullptr);
}

long now_ms() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

uintptr_t pc_of(void* uctx) {
    if (uctx == nullptr) return 0;
    auto* uc = static_cast<ucontext_t*>(uctx);
#if defined(__x86_64__)
    return static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
    return static_cast<uintptr_t>(uc->uc_mcontext.pc);
#else
    (void)uc;
    return 0;
#endif
}

// What this thread is: its pthread id, its GIL state asked of the runtime, its native frames.
void fill_slot(Slot& slot, void* uctx) {
    slot.pthread_id = static_cast<unsigned long>(pthread_self());
    if (Py_IsInitialized()) {
        slot.has_tstate = PyGILState_GetThisThreadState() != nullptr ? 1 : 0;
        slot.holds_gil = slot.has_tstate ? PyGILState_Check() : 0;
    }
    slot.pc = pc_of(uctx);
    slot.nframes = backtrace(slot.frames, kMaxFrames);
}

void thread_handler(int, siginfo_t* info, void* uctx) {
    int saved = errno;
    g_inside.fetch_add(1);
    int gen = g_active.load(std::memory_order_acquire);
    if (gen == 0 || g_disarmed.load() || info == nullptr || info->si_code != SI_TKILL ||
        info->si_pid != g_pid) {
        g_inside.fetch_sub(1);
        errno = saved;
        return;
    }
    pid_t me = sys_gettid();
    int n = g_nslots.load(std::memory_order_acquire);
    for (int k = 0; k < n; ++k) {
        Slot& slot = g_slots[k];
        if (slot.tid.load(std::memory_order_acquire) != me || slot.gen.load() != gen) continue;
        if (slot.state.load(std::memory_order_acquire) != kPending) break;
        fill_slot(slot, uctx);
        slot.state.store(kDone, std::memory_order_release);
        // Parked until the Python stacks are written, so they do not change under faulthandler.
        long until = now_ms() + kParkMs;
        while (g_release.load(std::memory_order_acquire) != gen && g_active.load() == gen && now_ms() < until)
            sleep_us(200);
        break;
    }
    g_inside.fetch_sub(1);
    errno = saved;
}

// Whether thread ``tid`` of this process blocks ``sig`` (its SigBlk mask): it would never answer, so the
// trigger handler neither signals nor waits for it.
bool blocks_signal(int tid, int sig) {
    char path[64];
    // "/proc/self/task/TID/status" without stdio
    const char* head = "/proc/self/task/";
    size_t n = strlen(head);
    memcpy(path, head, n);
    char d[16];
    int k = 0;
    unsigned v = static_cast<unsigned>(tid);
    do { d[k++] = static_cast<char>('0' + v % 10); v /= 10; } while (v && k < 16);
    while (k) path[n++] = d[--k];
    memcpy(path + n, "/status", 8);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t got = read(fd, g_copy, sizeof(g_copy) - 1);
    close(fd);
    if (got <= 0) return false;
    g_copy[got] = '\0';
    const char* at = strstr(g_copy, "SigBlk:");
    if (at == nullptr) return false;
    at += 7;
    while (*at == ' ' || *at == '\t') ++at;
    unsigned long long mask = 0;
    for (; (*at >= '0' && *at <= '9') || (*at >= 'a' && *at <= 'f'); ++at)
        mask = (mask << 4) | static_cast<unsigned long long>(*at <= '9' ? *at - '0' : *at - 'a' + 10);
    return (mask >> (sig - 1)) & 1ULL;
}

// Reads /proc/self/task/TID/NAME into buf (NUL-terminated); the byte count, or -1. Signal-safe.
ssize_t read_task_file(int tid, const char* name, char* buf, size_t size) {
    char path[64];
    const char* head = "/proc/self/task/";
    size_t n = strlen(head);
    memcpy(path, head, n);
    char d[16];
    int k = 0;
    unsigned v = static_cast<unsigned>(tid);
    do { d[k++] = static_cast<char>('0' + v % 10); v /= 10; } while (v && k < 16);
    while (k) path[n++] = d[--k];
    path[n++] = '/';
    size_t len = strlen(name);
    if (n + len + 1 > sizeof(path)) return -1;
    memcpy(path + n, name, len + 1);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t got = read(fd, buf, size - 1);
    close(fd);
    buf[got > 0 ? got : 0] = '\0';
    return got;
}

// Whether thread ``tid`` sleeps in nanosleep/clock_nanosleep (its /proc/self/task/TID/syscall): a handler
// would end the sleep early (Linux never restarts these), and C code calling sleep() once would wake.
// A sleep that a stop (SIGSTOP, a debugger) interrupted resumes in restart_syscall, as do timed futex waits
// (a GIL waiter's in take_gil, which must be read): there the kernel's wait channel tells them apart, a
// futex wait naming futex, a resumed sleep naming the nanosleep restart (or only the syscall entry, where
// that restart is inlined).
bool asleep(int tid) {
#if defined(__x86_64__)
    constexpr long kNanosleep = 35, kClockNanosleep = 230, kRestart = 219;
#elif defined(__aarch64__)
    constexpr long kNanosleep = 101, kClockNanosleep = 115, kRestart = 128;
#else
    constexpr long kNanosleep = -2, kClockNanosleep = -2, kRestart = -2;
#endif
    char buf[64];
    ssize_t got = read_task_file(tid, "syscall", buf, sizeof(buf));
    if (got <= 0 || buf[0] < '0' || buf[0] > '9') return false;
    long nr = 0;
    for (ssize_t i = 0; i < got && buf[i] >= '0' && buf[i] <= '9'; ++i) nr = nr * 10 + (buf[i] - '0');
    if (nr == kNanosleep || nr == kClockNanosleep) return true;
    if (nr != kRestart) return false;
    if (read_task_file(tid, "wchan", buf, sizeof(buf)) <= 0) return false;
    return strstr(buf, "nanosleep") != nullptr || strcmp(buf, "do_syscall_64") == 0;
}

// Every thread state of every interpreter: its pthread id and kernel tid, so the Python stack of a thread
// that was not interrupted (asleep, blocking the signal) is still attributed; on 3.10 and 3.11 also which
// one is the runtime's current thread state (the GIL holder), a global there (thread-local from 3.12).
void write_tstates(Out& out) {
#if PY_VERSION_HEX < 0x030C0000
    PyThreadState* current = _PyThreadState_UncheckedGet();
#endif
    int guard = 0;
    for (PyInterpreterState* interp = PyInterpreterState_Head(); interp != nullptr && guard < 64;
         interp = PyInterpreterState_Next(interp), ++guard) {
        int count = 0;
        for (PyThreadState* ts = PyInterpreterState_ThreadHead(interp); ts != nullptr && count < kMaxSlots;
             ts = PyThreadState_Next(ts), ++count) {
            out.s("tstate pthread ").x(ts->thread_id);
#if PY_VERSION_HEX >= 0x030B0000
            out.s(" native ").u(ts->native_thread_id);
#endif
#if PY_VERSION_HEX < 0x030C0000
            out.s(" current ").i(ts == current ? 1 : 0);
#endif
            out.s("\n");
        }
    }
}

int list_tasks(int* tids, int cap) {
    int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return 0;
    int n = 0;
    for (;;) {
        long got = syscall(SYS_getdents64, fd, g_dents, sizeof(g_dents));
        if (got <= 0) break;
        for (long off = 0; off < got;) {
            auto* d = reinterpret_cast<struct dirent64*>(g_dents + off);
            off += d->d_reclen;
            const char* p = d->d_name;
            if (*p < '0' || *p > '9') continue;
            long v = 0;
            for (; *p >= '0' && *p <= '9'; ++p) v = v * 10 + (*p - '0');
            if (n < cap) tids[n++] = static_cast<int>(v);
        }
    }
    close(fd);
    return n;
}

void copy_file(Out& out, const char* path) {
    out.flush();
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    for (;;) {
        ssize_t r = read(fd, g_copy, sizeof(g_copy));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        ssize_t off = 0;
        while (off < r) {
            ssize_t w = write(out.fd, g_copy + off, static_cast<size_t>(r - off));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            off += w;
        }
    }
    close(fd);
}

void call_faulthandler(int sig, siginfo_t* info, void* uctx) {
    if (!g_have_fault) return;
    if (g_fault_prev.sa_flags & SA_SIGINFO) {
        if (g_fault_prev.sa_sigaction != nullptr) g_fault_prev.sa_sigaction(sig, info, uctx);
    } else if (g_fault_prev.sa_handler != SIG_DFL && g_fault_prev.sa_handler != SIG_IGN &&
               g_fault_prev.sa_handler != nullptr) {
        g_fault_prev.sa_handler(sig);
    }
}

// Writes the dump into PID.NONCE.tmp; true when it is complete and still wanted (the caller renames it
// once this dump's state is released, so the next request never finds the agent busy with this one).
bool dump(int sig, siginfo_t* info, void* uctx, unsigned nonce, char* req, char* tmp) {
    name_of(req, 64, nonce, "req");
    struct stat st;
    if (fstatat(g_dirfd, req, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != g_uid || !S_ISREG(st.st_mode))
        return false;
    name_of(tmp, 64, nonce, "tmp");
    int fd = openat(g_dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    long t0 = now_ms();
    int gen = ++g_gen;
    if (gen <= 0) gen = g_gen = 1;
    pid_t me = sys_gettid();
    // A thread still leaving its handler from the previous dump has the thread signal blocked for now:
    // let it leave, so that "blocked" below means a thread that blocks the signal itself.
    for (long until = now_ms() + 100; g_inside.load() > 0 && now_ms() < until;) sleep_us(100);
    int n = list_tasks(g_tids, kMaxSlots);
    for (int k = 0; k < n; ++k) {
        Slot& slot = g_slots[k];
        slot.state.store(kPending, std::memory_order_relaxed);
        slot.gen.store(gen, std::memory_order_relaxed);
        slot.nframes = 0;
        slot.pc = 0;
        slot.holds_gil = -1;
        slot.has_tstate = -1;
        slot.pthread_id = 0;
        slot.tid.store(g_tids[k], std::memory_order_release);
    }
    g_nslots.store(n, std::memory_order_release);
    g_active.store(gen, std::memory_order_release);
    int sent = 0;
    for (int k = 0; k < n; ++k) {
        if (g_tids[k] == me) {
            fill_slot(g_slots[k], uctx);
            g_slots[k].state.store(kDone, std::memory_order_release);
        } else if (blocks_signal(g_tids[k], g_thread)) {
            g_slots[k].state.store(kBlocked, std::memory_order_release);
        } else if (asleep(g_tids[k])) {
            g_slots[k].state.store(kAsleep, std::memory_order_release);
        } else if (syscall(SYS_tgkill, g_pid, g_tids[k], g_thread) == 0) {
            ++sent;
        }
    }
    long until = now_ms() + kCollectMs;
    for (;;) {
        int pending = 0;
        for (int k = 0; k < n; ++k) pending += g_slots[k].state.load(std::memory_order_acquire) == kPending;
        if (pending == 0 || now_ms() >= until) break;
        sleep_us(100);
    }
    long collected = now_ms();

    Out out{fd};
    out.s("kvdiag-agent 1\npid ").i(g_pid).s("\ntid ").i(me).s("\ngen ").i(gen).s("\npython ")
        .u(PY_MAJOR_VERSION).s(".").u(PY_MINOR_VERSION).s(".").u(PY_MICRO_VERSION)
        .s("\nthreads ").i(n).s("\nsignalled ").i(sent).s("\ncollect_ms ").i(collected - t0).s("\n");
    out.s("python-stacks\n");
    out.flush();
    if (Py_IsInitialized() && g_placeholder >= 0 && dup3(fd, g_placeholder, O_CLOEXEC) >= 0) {
        call_faulthandler(sig, info, uctx);
        dup3(g_devnull, g_placeholder, O_CLOEXEC);
    }
    out.s("end-python-stacks\n");
    for (int k = 0; k < n; ++k) {
        Slot& slot = g_slots[k];
        int state = slot.state.load(std::memory_order_acquire);
        bool answered = state == kDone;
        out.s("thread ").i(slot.tid.load()).s(answered ? " answered" : state == kBlocked ? " blocked"
                                                  : state == kAsleep ? " asleep" : " noanswer");
        if (answered) {
            out.s(" pthread ").x(slot.pthread_id).s(" gil ").i(slot.holds_gil).s(" tstate ").i(slot.has_tstate)
                .s(" pc ").x(slot.pc).s(" frames");
            for (int f = 0; f < slot.nframes; ++f) out.s(" ").x(reinterpret_cast<uintptr_t>(slot.frames[f]));
        }
        out.s("\n");
    }
    if (Py_IsInitialized()) write_tstates(out);
    g_release.store(gen, std::memory_order_release);
    out.s("maps\n");
    copy_file(out, "/proc/self/maps");
    out.s("end-maps\nelapsed_ms ").i(now_ms() - t0).s("\nend\n");
    out.flush();
    close(fd);
    g_dumps.fetch_add(1);
    g_active.store(0, std::memory_order_release);
    return true;
}

void trigger_handler(int sig, siginfo_t* info, void* uctx) {
    int saved = errno;
    if (!g_disarmed.load() && info != nullptr && info->si_code == SI_QUEUE && getpid() == g_pid &&
        (info->si_uid == g_uid || info->si_uid == 0)) {
        int expected = 0;
        if (g_busy.compare_exchange_strong(expected, 1)) {
            char req[64], tmp[64], done[64];
            unsigned nonce = static_cast<unsigned>(info->si_value.sival_int);
            bool written = dump(sig, info, uctx, nonce, req, tmp);
            g_busy.store(0);
            if (written) {
                // kvdiag removes its request when it stops waiting: an answer nobody waits for is dropped.
                struct stat st;
                name_of(done, sizeof(done), nonce, "dump");
                if (fstatat(g_dirfd, req, &st, AT_SYMLINK_NOFOLLOW) == 0)
                    renameat(g_dirfd, tmp, g_dirfd, done);
                else
                    unlinkat(g_dirfd, tmp, 0);
            }
        }
    }
    errno = saved;
}

bool signal_free(int sig) {
    struct sigaction cur;
    if (sigaction(sig, nullptr, &cur) != 0) return false;
    return !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == SIG_DFL;
}

// Opens the directory and the placeholder fd, primes backtrace(), picks two free real-time signals.
std::tuple<int, int, int> prepare(const std::string& dir) {
    if (g_dirfd >= 0) return {g_placeholder, g_trigger, g_thread};
    int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (dfd < 0) throw std::runtime_error("cannot open the agent directory " + dir + ": " + strerror(errno));
    int null_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    int ph = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null_fd < 0 || ph < 0) {
        close(dfd);
        throw std::runtime_error("cannot open /dev/null");
    }
    void* prime[4];
    backtrace(prime, 4);   // loads libgcc_s now: the first call allocates, later ones do not
    int picked[2] = {0, 0};
    int k = 0;
    for (int sig = SIGRTMAX - 2; sig > SIGRTMIN + 1 && k < 2; --sig)
        if (signal_free(sig)) picked[k++] = sig;
    if (k < 2) {
        close(dfd); close(null_fd); close(ph);
        throw std::runtime_error("no two free real-time signals");
    }
    g_dirfd = dfd;
    g_devnull = null_fd;
    g_placeholder = ph;
    g_trigger = picked[0];
    g_thread = picked[1];
    g_pid = getpid();
    g_uid = getuid();
    return {g_placeholder, g_trigger, g_thread};
}

// Our handlers in front of whatever handles the trigger now (faulthandler's, kept to call).
void install() {
    if (g_dirfd < 0) throw std::runtime_error("prepare() first");
    struct sigaction prev;
    if (sigaction(g_trigger, nullptr, &prev) != 0) throw std::runtime_error("sigaction failed");
    // Called twice at arm time: before faulthandler.register (prev: the default action, nothing to call)
    // and after it (prev: faulthandler's handler, which writes the Python stacks).
    if (!((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction == trigger_handler)) {
        g_fault_prev = prev;
        g_have_fault = !(prev.sa_flags & SA_SIGINFO) && prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN;
        if (prev.sa_flags & SA_SIGINFO) g_have_fault = prev.sa_sigaction != nullptr;
    }
    struct sigaction th{};
    th.sa_sigaction = thread_handler;
    th.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&th.sa_mask);
    sigaddset(&th.sa_mask, g_trigger);
    struct sigaction tr{};
    tr.sa_sigaction = trigger_handler;
    tr.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&tr.sa_mask);
    sigaddset(&tr.sa_mask, g_thread);
    if (sigaction(g_thread, &th, nullptr) != 0 || sigaction(g_trigger, &tr, nullptr) != 0)
        throw std::runtime_error("sigaction failed");
    g_disarmed.store(0);
}

// In a child after fork(): the same handlers answer for the new pid.
void rearm_child() {
    g_pid = getpid();
    g_busy.store(0);
    g_active.store(0);
}

// Handlers stay installed (a real-time signal's default action ends the process) but answer nothing.
void disarm() { g_disarmed.store(1); }

unsigned dumps() { return g_dumps.load(); }

}  // namespace

NB_MODULE(_dumper, m) {
    m.def("prepare", &prepare, nb::arg("directory"),
          "Open the agent directory, prime backtrace(), pick the signals: (placeholder_fd, trigger, thread).");
    m.def("install", &install, "Install the trigger and per-thread handlers (after faulthandler.register).");
    m.def("rearm_child", &rearm_child, "In a forked child: answer for the new pid.");
    m.def("disarm", &disarm, "Make the handlers answer nothing (at interpreter exit).");
    m.def("dumps", &dumps, "How many dumps this process has written.");
}
