/*
 * sandfleet-agent: the in-sandbox agent, PID 1 of every sandbox.
 *
 * One request per connection. PID 1 only accepts, forks a handler per
 * connection, reaps every child (orphans included) and drains the output
 * pipes of background jobs that outlive their command. Everything that
 * allocates runs in the forked handler, so PID 1 stays a few pages big.
 * The wire protocol is documented in protocol.py next to this file.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define VERSION "0.1.0"
#define MAX_FRAME (4u << 20)  /* argv + env of one exec fit; ARG_MAX is 2 MiB */
#define CHUNK (256u << 10)    /* file data frames */
#define PIPE_READ (64u << 10) /* one read from a command's pipe */
#define MAX_DRAIN 256         /* background pipes PID 1 keeps draining */
#define IDLE_TIMEOUT_S 120    /* a client silent this long mid-request is gone */

extern char **environ;

static volatile sig_atomic_t got_chld, got_alrm, got_term;
static sigset_t wait_mask;  /* mask while sleeping in ppoll: our signals open */
static int handoff[2] = {-1, -1}; /* handler -> PID 1: pipe fds to keep draining */
static const char *sock_path;
static pid_t main_pid; /* ping reports the agent, not the handler */

/* Big buffers live in BSS: untouched pages cost no RSS, and only handlers touch them. */
static uint8_t req_buf[MAX_FRAME];
static uint8_t data_buf[MAX_FRAME];
static uint8_t io_buf[CHUNK];

static void on_signal(int sig)
{
	if (sig == SIGCHLD) got_chld = 1;
	else if (sig == SIGALRM) got_alrm = 1;
	else got_term = 1;
}

static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

static void put32(uint8_t *p, uint32_t v)
{
	p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ exec state */

/* Set while a handler runs a command: a timer firing in any wait kills its group. */
static pid_t cmd_pid;
static int sock_nonblock; /* exec switches the socket to non-blocking I/O */
static int timed_out;

static void check_timer(void)
{
	if (got_alrm && cmd_pid > 0 && !timed_out) {
		kill(-cmd_pid, SIGKILL);
		timed_out = 1;
	}
}

static void client_gone(void)
{
	/* Nobody waits for the answer: do not leave the command running. */
	if (cmd_pid > 0) {
		kill(-cmd_pid, SIGKILL);
		waitpid(cmd_pid, NULL, 0);
	}
	_exit(0);
}

/* ------------------------------------------------------------------ socket I/O */

static int write_all(int fd, const void *buf, size_t n)
{
	const uint8_t *p = buf;
	while (n) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w > 0) {
			p += w;
			n -= (size_t)w;
		} else if (w < 0 && errno == EINTR) {
			continue;
		} else if (w < 0 && errno == EAGAIN && sock_nonblock) {
			struct pollfd pfd = {.fd = fd, .events = POLLOUT};
			ppoll(&pfd, 1, NULL, &wait_mask);
			check_timer();
			if (pfd.revents & (POLLERR | POLLHUP)) return -1;
		} else {
			return -1;
		}
	}
	return 0;
}

static void send_frame(int fd, uint8_t type, const void *payload, size_t n)
{
	uint8_t hdr[5];
	put32(hdr, (uint32_t)n);
	hdr[4] = type;
	if (write_all(fd, hdr, 5) < 0 || (n && write_all(fd, payload, n) < 0)) client_gone();
}

static void send_err(int fd, int err, const char *fmt, ...)
{
	uint8_t msg[4 + 1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf((char *)msg + 4, sizeof msg - 4, fmt, ap);
	va_end(ap);
	if (n < 0) n = 0;
	if ((size_t)n > sizeof msg - 5) n = sizeof msg - 5;
	put32(msg, (uint32_t)err);
	send_frame(fd, 'E', msg, 4 + (size_t)n);
}

/* Blocking read of exactly n bytes; -1 on EOF, error or idle timeout. */
static int read_full(int fd, uint8_t *p, size_t n)
{
	while (n) {
		ssize_t r = read(fd, p, n);
		if (r > 0) {
			p += r;
			n -= (size_t)r;
		} else if (r < 0 && errno == EINTR) {
			continue;
		} else {
			return -1;
		}
	}
	return 0;
}

static int read_frame(int fd, uint8_t *type, uint8_t *buf, uint32_t *len)
{
	uint8_t hdr[5];
	if (read_full(fd, hdr, 5) < 0) return -1;
	*len = get32(hdr);
	*type = hdr[4];
	if (*len > MAX_FRAME) return -1;
	return read_full(fd, buf, *len);
}

/* ------------------------------------------------------------------ request fields */

struct field {
	uint8_t tag;
	uint32_t len;
	const uint8_t *val;
};

/* Iterates TLV fields: tag u8, length u32 BE, value. Returns 0 at the end, -1 if malformed. */
static int next_field(const uint8_t *buf, uint32_t n, uint32_t *off, struct field *f)
{
	if (*off == n) return 0;
	if (n - *off < 5) return -1;
	f->tag = buf[*off];
	f->len = get32(buf + *off + 1);
	if (f->len > n - *off - 5) return -1;
	f->val = buf + *off + 5;
	*off += 5 + f->len;
	return 1;
}

/* A NUL-terminated copy; NULL if the value holds a NUL byte. */
static char *field_str(const struct field *f)
{
	if (memchr(f->val, 0, f->len)) return NULL;
	char *s = malloc(f->len + 1);
	if (!s) _exit(1);
	memcpy(s, f->val, f->len);
	s[f->len] = 0;
	return s;
}

static uint64_t field_u64(const struct field *f)
{
	uint64_t v = 0;
	for (uint32_t i = 0; i < f->len && i < 8; i++) v = v << 8 | f->val[i];
	return v;
}

/* ------------------------------------------------------------------ exec */

struct stream {
	int fd;              /* read end of the command's pipe, -1 at EOF */
	uint8_t type;        /* '1' stdout, '2' stderr */
	uint64_t head_left;  /* bytes still streamed live */
	uint64_t cap;        /* tail ring size */
	uint8_t *ring;       /* mmap'd on first use, so small outputs cost nothing */
	uint64_t pos, len, dropped;
};

/* Head bytes go out live; past the head, only the last `cap` bytes are kept. */
static void emit(int c, struct stream *s, const uint8_t *d, size_t n)
{
	if (s->head_left) {
		size_t k = n < s->head_left ? n : (size_t)s->head_left;
		send_frame(c, s->type, d, k);
		s->head_left -= k;
		d += k;
		n -= k;
	}
	if (!n) return;
	if (!s->ring && s->cap) {
		void *m = mmap(NULL, s->cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) s->cap = 0;
		else s->ring = m;
	}
	if (!s->cap) {
		s->dropped += n;
		return;
	}
	if (n >= s->cap) {
		s->dropped += s->len + (n - s->cap);
		memcpy(s->ring, d + n - s->cap, s->cap);
		s->pos = 0;
		s->len = s->cap;
		return;
	}
	uint64_t over = s->len + n > s->cap ? s->len + n - s->cap : 0;
	uint64_t w = (s->pos + s->len) % s->cap;
	uint64_t first = s->cap - w < n ? s->cap - w : n;
	memcpy(s->ring + w, d, first);
	memcpy(s->ring, d + first, n - first);
	s->dropped += over;
	s->len = s->len + n - over;
	s->pos = (s->pos + over) % s->cap;
}

static void flush_tail(int c, struct stream *s)
{
	while (s->len) {
		uint64_t k = s->cap - s->pos < s->len ? s->cap - s->pos : s->len;
		if (k > CHUNK) k = CHUNK;
		send_frame(c, s->type, s->ring + s->pos, k);
		s->pos = (s->pos + k) % s->cap;
		s->len -= k;
	}
}

/* Returns 0 at EOF or a hard error, 1 if data was read, -1 if nothing is there now. */
static int pump(int c, struct stream *s)
{
	ssize_t r = read(s->fd, io_buf, PIPE_READ);
	if (r > 0) {
		emit(c, s, io_buf, (size_t)r);
		return 1;
	}
	if (r < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
	close(s->fd);
	s->fd = -1;
	return 0;
}

/* Pipes still open after the command exited belong to its background jobs:
 * PID 1 keeps reading them so those jobs never die of SIGPIPE. */
static void hand_off(int fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	uint8_t dummy = 0;
	struct iovec iov = {.iov_base = &dummy, .iov_len = 1};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof cbuf};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof fd);
	sendmsg(handoff[1], &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
	close(fd);
}

static char **build_env(char **req_env, size_t n_req)
{
	static const char *defaults[] = {
	    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"};
	size_t n_own = 0;
	while (environ[n_own]) n_own++;
	char **env = calloc(2 + n_own + n_req + 1, sizeof *env);
	size_t n = 0;
	if (!env) _exit(1);
	/* Later entries win: defaults < the agent's own env < the request's env. */
	for (int layer = 0; layer < 3; layer++) {
		size_t count = layer == 0 ? 2 : layer == 1 ? n_own : n_req;
		for (size_t i = 0; i < count; i++) {
			char *kv = layer == 0 ? (char *)defaults[i] : layer == 1 ? environ[i] : req_env[i];
			const char *eq = strchr(kv, '=');
			size_t klen = eq ? (size_t)(eq - kv) : strlen(kv);
			size_t j;
			for (j = 0; j < n; j++)
				if (!strncmp(env[j], kv, klen) && env[j][klen] == '=') break;
			env[j] = kv;
			if (j == n) n++;
		}
	}
	env[n] = NULL;
	return env;
}

static void run_child(char **argv, char **env, int in, int out, int err)
{
	setsid();
	dup2(in, 0);
	dup2(out, 1);
	dup2(err, 2);
	for (int sig = 1; sig < NSIG; sig++) signal(sig, SIG_DFL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	environ = env; /* execvp searches the command's own PATH */
	execvp(argv[0], argv);
	int e = errno;
	dprintf(2, "sandfleet-agent: %s: %s\n", argv[0], e == ENOENT ? "command not found" : strerror(e));
	_exit(e == ENOENT ? 127 : 126);
}

static void op_exec(int c, const uint8_t *req, uint32_t n)
{
	struct field f;
	uint32_t off = 0;
	size_t n_argv = 0, n_env = 0;
	char *shell = NULL, *cwd = NULL;
	uint64_t timeout_ms = 60000, max_out = 16u << 20;
	int r;
	while ((r = next_field(req, n, &off, &f)) > 0) n_argv += f.tag == 'a', n_env += f.tag == 'e';
	char **argv = calloc(n_argv + 4, sizeof *argv), **renv = calloc(n_env + 1, sizeof *renv);
	if (!argv || !renv) _exit(1);
	if (r < 0) {
		send_err(c, EINVAL, "exec: malformed request");
		return;
	}
	n_argv = n_env = 0;
	off = 0;
	while ((r = next_field(req, n, &off, &f)) > 0) {
		char *s = NULL;
		if (f.tag && strchr("acde", f.tag) && !(s = field_str(&f))) {
			send_err(c, EINVAL, "exec: argument, env or cwd contains a NUL byte");
			return;
		}
		switch (f.tag) {
		case 'a': argv[n_argv++] = s; break;
		case 'c': shell = s; break;
		case 'e':
			if (!strchr(s, '=')) {
				send_err(c, EINVAL, "exec: env entry '%s' has no '='", s);
				return;
			}
			renv[n_env++] = s;
			break;
		case 'd': cwd = s; break;
		case 't': timeout_ms = field_u64(&f); break;
		case 'o': max_out = field_u64(&f); break;
		}
	}
	if (r < 0 || (!shell && !n_argv)) {
		send_err(c, EINVAL, "exec: malformed request (no command)");
		return;
	}
	if (shell) {
		argv[0] = "/bin/sh";
		argv[1] = "-c";
		argv[2] = shell;
		argv[3] = NULL;
	}
	if (cwd) {
		struct stat st;
		int e = 0;
		if (stat(cwd, &st) < 0) e = errno;
		else if (!S_ISDIR(st.st_mode)) e = ENOTDIR;
		else if (chdir(cwd) < 0) e = errno;
		if (e) {
			send_err(c, e, "cwd '%s': %s", cwd, e == ENOENT ? "no such directory" : strerror(e));
			return;
		}
	}
	char **env = build_env(renv, n_env);

	int pin[2], pout[2], perr[2];
	if (pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0) {
		send_err(c, errno, "exec: pipe: %s", strerror(errno));
		return;
	}
	uint64_t t0 = now_ns();
	pid_t pid = fork();
	if (pid < 0) {
		send_err(c, errno, "exec: fork: %s (process limit reached?)", strerror(errno));
		return;
	}
	if (pid == 0) run_child(argv, env, pin[0], pout[1], perr[1]);
	cmd_pid = pid;
	close(pin[0]);
	close(pout[1]);
	close(perr[1]);
	fcntl(c, F_SETFL, O_NONBLOCK);
	sock_nonblock = 1;
	fcntl(pin[1], F_SETFL, O_NONBLOCK);
	fcntl(pout[0], F_SETFL, O_NONBLOCK);
	fcntl(perr[0], F_SETFL, O_NONBLOCK);
	struct itimerval it = {{0, 0}, {(time_t)(timeout_ms / 1000), (suseconds_t)(timeout_ms % 1000) * 1000}};
	if (timeout_ms == 0) it.it_value.tv_usec = 1;
	setitimer(ITIMER_REAL, &it, NULL);

	struct stream so = {pout[0], '1', max_out - max_out / 2, max_out / 2, NULL, 0, 0, 0};
	struct stream se = {perr[0], '2', max_out - max_out / 2, max_out / 2, NULL, 0, 0, 0};
	/* stdin: frames are read off the socket one at a time into data_buf */
	int in_fd = pin[1], in_eof = 0;
	uint8_t hdr[5];
	uint32_t hgot = 0, plen = 0, pgot = 0, pdone = 0, have = 0;
	int status = 0, exited = 0;

	while (!exited) {
		check_timer();
		if (got_chld) {
			got_chld = 0;
			if (waitpid(pid, &status, WNOHANG) == pid) break;
		}
		struct pollfd p[4] = {
		    {.fd = so.fd, .events = POLLIN}, {.fd = se.fd, .events = POLLIN},
		    {.fd = c, .events = (!have && !in_eof) ? POLLIN : 0},
		    {.fd = have && in_fd >= 0 ? in_fd : -1, .events = POLLOUT}};
		if (ppoll(p, 4, NULL, &wait_mask) < 0) continue;
		if (p[0].revents) pump(c, &so);
		if (p[1].revents) pump(c, &se);
		if (p[2].revents & POLLIN) {
			/* incremental frame reader: never blocks, so the timer always fires */
			ssize_t k;
			if (hgot < 5) {
				k = read(c, hdr + hgot, 5 - hgot);
				if (k == 0) client_gone();
				if (k > 0 && (hgot += (uint32_t)k) == 5) {
					plen = get32(hdr);
					pgot = 0;
					if (plen > MAX_FRAME || (hdr[4] != 'D' && hdr[4] != 'Z')) client_gone();
				}
			} else {
				k = read(c, data_buf + pgot, plen - pgot);
				if (k == 0) client_gone();
				if (k > 0) pgot += (uint32_t)k;
			}
			if (hgot == 5 && pgot == plen) {
				hgot = 0;
				if (hdr[4] == 'Z') {
					in_eof = 1;
					if (in_fd >= 0) close(in_fd);
					in_fd = -1;
				} else if (in_fd >= 0) {
					have = plen;
					pdone = 0;
				}
			}
		} else if (p[2].revents & (POLLHUP | POLLERR)) {
			client_gone();
		}
		if (p[3].revents) {
			ssize_t w = write(in_fd, data_buf + pdone, have - pdone);
			if (w > 0 && (pdone += (uint32_t)w) == have) have = 0;
			if (w < 0 && errno != EAGAIN && errno != EINTR) {
				/* the command closed its stdin: discard the rest */
				close(in_fd);
				in_fd = -1;
				have = 0;
			}
		}
	}
	uint64_t dur = now_ns() - t0;
	cmd_pid = 0;
	struct itimerval off_timer = {{0, 0}, {0, 0}};
	setitimer(ITIMER_REAL, &off_timer, NULL);
	if (in_fd >= 0) close(in_fd);
	/* What the command wrote before exiting is already in the pipes; read it,
	 * but never wait for background jobs that still hold the write ends. */
	struct stream *streams[2] = {&so, &se};
	for (int k = 0; k < 2; k++) {
		struct stream *s = streams[k];
		for (int i = 0; s->fd >= 0 && i < 64 && pump(c, s) > 0; i++) {
		}
		if (s->fd >= 0) hand_off(s->fd);
		flush_tail(c, s);
	}
	uint8_t res[33] = {0};
	if (timed_out) {
		res[0] = 2;
	} else if (WIFSIGNALED(status)) {
		res[0] = 1;
		put32(res + 5, (uint32_t)WTERMSIG(status));
	} else {
		put32(res + 1, (uint32_t)WEXITSTATUS(status));
	}
	put64(res + 9, so.dropped);
	put64(res + 17, se.dropped);
	put64(res + 25, dur);
	send_frame(c, 'X', res, sizeof res);
}

/* ------------------------------------------------------------------ files */

static const char *base_name(const char *path)
{
	const char *end = path + strlen(path);
	while (end > path + 1 && end[-1] == '/') end--;
	const char *b = end;
	while (b > path && b[-1] != '/') b--;
	return b;
}

/* Entry frame: type u8, size u64, mode u32, mtime_ns i64, then the name. */
static void send_entry(int c, const char *name, const struct stat *st)
{
	uint8_t buf[25 + NAME_MAX + 1];
	size_t nl = strlen(name);
	if (nl > NAME_MAX + 1) nl = NAME_MAX + 1;
	buf[0] = S_ISREG(st->st_mode) ? 0 : S_ISDIR(st->st_mode) ? 1 : S_ISLNK(st->st_mode) ? 2 : 3;
	put64(buf + 1, (uint64_t)st->st_size);
	put32(buf + 9, st->st_mode & 07777);
	put64(buf + 13, (uint64_t)st->st_mtim.tv_sec * 1000000000u + (uint64_t)st->st_mtim.tv_nsec);
	memcpy(buf + 21, name, nl);
	send_frame(c, 'F', buf, 21 + nl);
}

static int stat_reply(int c, const char *what, const char *path)
{
	struct stat st;
	if (lstat(path, &st) < 0) {
		send_err(c, errno, "%s '%s': %s", what, path, strerror(errno));
		return -1;
	}
	send_entry(c, base_name(path), &st);
	return 0;
}

static void op_read(int c, const char *path)
{
	struct stat st;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		send_err(c, errno, "read '%s': %s", path, strerror(errno));
		return;
	}
	if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
		send_err(c, EISDIR, "read '%s': is a directory", path);
		return;
	}
	for (;;) {
		ssize_t r = read(fd, io_buf, CHUNK);
		if (r < 0 && errno == EINTR) continue;
		if (r < 0) {
			send_err(c, errno, "read '%s': %s", path, strerror(errno));
			return;
		}
		if (r == 0) break;
		send_frame(c, 'D', io_buf, (size_t)r);
	}
	send_frame(c, 'Z', NULL, 0);
}

static char tmp_path[PATH_MAX + 64];

static void op_write(int c, const char *path, mode_t mode)
{
	struct stat st;
	const char *b = base_name(path);
	int e = 0;
	if (!*b || !strcmp(b, ".") || !strcmp(b, "..")) e = EINVAL;
	else if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) e = EISDIR;
	else if (snprintf(tmp_path, sizeof tmp_path, "%.*s.sandfleet-%d.tmp", (int)(b - path), path,
			  (int)getpid()) >= (int)sizeof tmp_path) e = ENAMETOOLONG;
	int fd = e ? -1 : open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (!e && fd < 0) e = errno;
	if (e) {
		send_err(c, e, "write '%s': %s", path, e == EISDIR ? "is a directory" : strerror(e));
		return;
	}
	uint8_t type = 0;
	uint32_t len;
	for (;;) {
		if (read_frame(c, &type, data_buf, &len) < 0) {
			unlink(tmp_path); /* client gone mid-upload: leave nothing behind */
			_exit(0);
		}
		if (type == 'Z') break;
		const uint8_t *p = data_buf;
		while (!e && len) {
			ssize_t w = write(fd, p, len);
			if (w < 0 && errno == EINTR) continue;
			if (w < 0) e = errno;
			else p += w, len -= (uint32_t)w;
		}
		if (e) break;
	}
	if (!e && fchmod(fd, mode & 07777) < 0) e = errno;
	if (close(fd) < 0 && !e) e = errno;
	if (!e && rename(tmp_path, path) < 0) e = errno;
	if (e) {
		unlink(tmp_path);
		send_err(c, e, "write '%s': %s", path, strerror(e));
		return;
	}
	stat_reply(c, "write", path);
}

static void op_list(int c, const char *path)
{
	DIR *d = opendir(path);
	if (!d) {
		send_err(c, errno, "list '%s': %s", path, strerror(errno));
		return;
	}
	struct dirent *de;
	struct stat st;
	while ((de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
		if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* vanished */
		send_entry(c, de->d_name, &st);
	}
	closedir(d);
	send_frame(c, 'Z', NULL, 0);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	return flag == FTW_DP ? rmdir(p) : unlink(p);
}

static void op_remove(int c, const char *path, int recursive)
{
	struct stat st;
	int r;
	if (lstat(path, &st) < 0) r = -1;
	else if (!S_ISDIR(st.st_mode)) r = unlink(path);
	else if (recursive) r = nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
	else r = rmdir(path);
	if (r < 0) send_err(c, errno, "remove '%s': %s", path, strerror(errno));
	else send_frame(c, 'K', NULL, 0);
}

static void op_mkdir(int c, char *path, int parents, mode_t mode)
{
	int r = 0;
	if (parents) {
		/* mkdir -p: every missing prefix, an existing directory is fine */
		for (char *s = path + 1;; s++) {
			if (*s && *s != '/') continue;
			char saved = *s;
			*s = 0;
			struct stat st;
			r = mkdir(path, mode);
			if (r < 0 && errno == EEXIST && stat(path, &st) == 0 && S_ISDIR(st.st_mode)) r = 0;
			*s = saved;
			if (r < 0 || !saved) break;
		}
	} else {
		r = mkdir(path, mode);
	}
	if (r < 0) {
		send_err(c, errno, "mkdir '%s': %s", path, strerror(errno));
		return;
	}
	stat_reply(c, "mkdir", path);
}

static size_t put_field(uint8_t *p, uint8_t tag, const char *val)
{
	size_t n = strlen(val);
	p[0] = tag;
	put32(p + 1, (uint32_t)n);
	memcpy(p + 5, val, n);
	return 5 + n;
}

static void op_ping(int c)
{
	uint8_t buf[64];
	char pid[16];
	snprintf(pid, sizeof pid, "%d", (int)main_pid);
	size_t n = put_field(buf, 'v', VERSION);
	n += put_field(buf + n, 'p', pid);
	send_frame(c, 'K', buf, n);
}

static void handle(int c)
{
	struct timeval tv = {IDLE_TIMEOUT_S, 0};
	uint8_t type;
	uint32_t len;
	/* a client that stops reading or writing must not pin a handler forever */
	setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	if (read_frame(c, &type, req_buf, &len) < 0) return;
	if (type == 'p') {
		op_ping(c);
		return;
	}
	if (type == 'x') {
		op_exec(c, req_buf, len);
		return;
	}
	struct field f;
	uint32_t off = 0;
	char *path = NULL;
	uint64_t flag = 0, mode = type == 'w' ? 0644 : 0755;
	int r;
	while ((r = next_field(req_buf, len, &off, &f)) > 0) {
		if (f.tag == 'P' && !(path = field_str(&f))) r = -1;
		if (r < 0) break;
		if (f.tag == 'R') flag = field_u64(&f);
		if (f.tag == 'M') mode = field_u64(&f);
	}
	if (r < 0 || !path || !*path) {
		send_err(c, EINVAL, "malformed request: the path is missing, empty or holds a NUL byte");
		return;
	}
	switch (type) {
	case 'r': op_read(c, path); break;
	case 'w': op_write(c, path, (mode_t)mode); break;
	case 'l': op_list(c, path); break;
	case 's': stat_reply(c, "stat", path); break;
	case 'u': op_remove(c, path, flag != 0); break;
	case 'm': op_mkdir(c, path, flag != 0, (mode_t)mode); break;
	default: send_err(c, EINVAL, "unknown request type 0x%02x (agent version %s)", type, VERSION);
	}
}

/* ------------------------------------------------------------------ PID 1 */

static void reap(void)
{
	got_chld = 0;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

/* Kills direct children (and their groups) until none is left; orphans of
 * killed ones come back to us as subreaper and go in the next round. */
static void kill_all(void)
{
	if (getpid() == 1) kill(-1, SIGKILL);
	for (int round = 0; round < 300; round++) {
		int found = 0;
		DIR *d = opendir("/proc");
		struct dirent *de;
		while (d && (de = readdir(d))) {
			char p[64], buf[512];
			int pid = atoi(de->d_name);
			if (pid <= 0) continue;
			snprintf(p, sizeof p, "/proc/%d/stat", pid);
			int fd = open(p, O_RDONLY | O_CLOEXEC);
			if (fd < 0) continue;
			ssize_t n = read(fd, buf, sizeof buf - 1);
			close(fd);
			if (n <= 0) continue;
			buf[n] = 0;
			char *rp = strrchr(buf, ')');
			int ppid = 0;
			char state = 0;
			if (rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == getpid()) {
				found++;
				kill(-pid, SIGKILL);
				kill(pid, SIGKILL);
			}
		}
		if (d) closedir(d);
		reap();
		if (!found) return;
		usleep(5000);
	}
}

static int listen_on(const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof a.sun_path) {
		fprintf(stderr, "sandfleet-agent: socket path too long (max %zu bytes): %s\n",
			sizeof a.sun_path - 1, path);
		exit(2);
	}
	strcpy(a.sun_path, path);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	unlink(path); /* a stale socket from an earlier run */
	/* umask keeps the socket private from the moment it exists */
	mode_t old = umask(0177);
	int r = s < 0 ? -1 : bind(s, (struct sockaddr *)&a, sizeof a);
	umask(old);
	if (r < 0 || chmod(path, 0600) < 0 || listen(s, 512) < 0) {
		fprintf(stderr, "sandfleet-agent: cannot listen on %s: %s\n", path, strerror(errno));
		exit(2);
	}
	return s;
}

static void serve(int ls)
{
	static struct pollfd p[2 + MAX_DRAIN];
	static uint8_t sink[4096];
	int nd = 0;
	for (;;) {
		if (got_chld) reap();
		if (got_term) return;
		p[0] = (struct pollfd){.fd = ls, .events = POLLIN};
		p[1] = (struct pollfd){.fd = handoff[0], .events = POLLIN};
		if (ppoll(p, 2 + (nfds_t)nd, NULL, &wait_mask) < 0) continue;
		for (int i = 2; i < 2 + nd; i++) {
			if (!p[i].revents) continue;
			ssize_t r = read(p[i].fd, sink, sizeof sink);
			if (r > 0 || (r < 0 && errno == EAGAIN)) continue;
			close(p[i].fd);
			p[i--] = p[1 + nd--];
		}
		if (p[1].revents & POLLIN) {
			char cbuf[CMSG_SPACE(sizeof(int))];
			uint8_t dummy;
			struct iovec iov = {.iov_base = &dummy, .iov_len = 1};
			struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
					    .msg_controllen = sizeof cbuf};
			struct cmsghdr *cm;
			int fd;
			if (recvmsg(handoff[0], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) > 0 &&
			    (cm = CMSG_FIRSTHDR(&mh)) && cm->cmsg_type == SCM_RIGHTS) {
				memcpy(&fd, CMSG_DATA(cm), sizeof fd);
				if (nd < MAX_DRAIN) p[2 + nd++] = (struct pollfd){.fd = fd, .events = POLLIN};
				else close(fd); /* too many: the job gets SIGPIPE if it writes */
			}
		}
		if (!(p[0].revents & POLLIN)) continue;
		int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) continue;
		pid_t pid = fork();
		if (pid == 0) {
			close(ls);
			close(handoff[0]);
			for (int i = 2; i < 2 + nd; i++) close(p[i].fd);
			signal(SIGTERM, SIG_DFL);
			signal(SIGINT, SIG_DFL);
			handle(c);
			/* Close only after the client did: closing with unread request data
			 * would reset the connection and lose the answer already sent. */
			shutdown(c, SHUT_WR);
			fcntl(c, F_SETFL, 0);
			while (read(c, data_buf, CHUNK) > 0) {
			}
			_exit(0);
		}
		if (pid < 0) {
			/* tiny and non-blocking: PID 1 must never wait on a client */
			uint8_t msg[128] = {0, 0, 0, 0, 'E', 0, 0, 0, (uint8_t)EAGAIN};
			int n = snprintf((char *)msg + 9, sizeof msg - 9, "agent cannot fork: %s", strerror(errno));
			put32(msg, (uint32_t)(4 + n));
			send(c, msg, 9 + (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
		}
		close(c);
	}
}

static void usage(void)
{
	fprintf(stderr, "usage: sandfleet-agent (--socket PATH | --listen-fd N) [--workdir DIR]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *workdir = NULL;
	int ls = -1;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--socket") && i + 1 < argc) sock_path = argv[++i];
		/* a listening socket made by the node (e.g. runc --preserve-fds):
		 * then no socket file needs to be visible inside the sandbox */
		else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) ls = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--workdir") && i + 1 < argc) workdir = argv[++i];
		else if (!strcmp(argv[i], "--version")) return puts("sandfleet-agent " VERSION) < 0;
		else usage();
	}
	if ((sock_path != NULL) == (ls >= 0)) usage(); /* exactly one of the two */
	/* As PID 1 of a bare box, 0-2 may be closed; keep pipes off those numbers. */
	for (int fd = 0; fd < 3; fd++)
		if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0) break;
	if (workdir && chdir(workdir) < 0) {
		fprintf(stderr, "sandfleet-agent: --workdir %s: %s\n", workdir, strerror(errno));
		return 2;
	}
	main_pid = getpid();
	if (main_pid != 1) prctl(PR_SET_CHILD_SUBREAPER, 1);

	struct sigaction sa = {.sa_handler = on_signal};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGCHLD, &sa, NULL);
	sigaction(SIGALRM, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	sigset_t block;
	sigemptyset(&block);
	sigaddset(&block, SIGCHLD);
	sigaddset(&block, SIGALRM);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	sigprocmask(SIG_BLOCK, &block, &wait_mask);
	sigdelset(&wait_mask, SIGCHLD);
	sigdelset(&wait_mask, SIGALRM);
	sigdelset(&wait_mask, SIGTERM);
	sigdelset(&wait_mask, SIGINT);

	if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, handoff) < 0) return 2;
	fcntl(handoff[0], F_SETFL, O_NONBLOCK);
	if (ls >= 0) {
		if (fcntl(ls, F_SETFD, FD_CLOEXEC) < 0 || fcntl(ls, F_SETFL, O_NONBLOCK) < 0) {
			fprintf(stderr, "sandfleet-agent: --listen-fd %d: %s\n", ls, strerror(errno));
			return 2;
		}
	} else {
		ls = listen_on(sock_path);
	}
	serve(ls);
	close(ls);
	if (sock_path) unlink(sock_path);
	kill_all();
	return 0;
}
