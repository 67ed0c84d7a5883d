package attnserve_test

// Tests against a live attnserve (the binary in $ATTNSERVE_BIN), with float64
// references computed here.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math"
	"math/big"
	mathrand "math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"attnserve/clients/go/attnserve"
	pb "attnserve/clients/go/attnservepb"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Float32 results against float64 references: |got - want| <= tol(1 + |want|).
const tol = 1e-5

const banner = "attnserve listening on "

var (
	serverBin string
	workDir   string
	plain     *server // no TLS, no tokens, the model "tiny"
	client    *attnserve.Client
	tiny      mhaWeights // the weights of "tiny"
)

func TestMain(m *testing.M) {
	serverBin = os.Getenv("ATTNSERVE_BIN")
	if serverBin == "" {
		fmt.Fprintln(os.Stderr, "ATTNSERVE_BIN must name the attnserve binary")
		os.Exit(2)
	}
	var err error
	if workDir, err = os.MkdirTemp("", "attnserve-go-test"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := run(m)
	os.RemoveAll(workDir)
	os.Exit(code)
}

func run(m *testing.M) int {
	tiny = randomWeights(mathrand.New(mathrand.NewSource(7)), 8, 2)
	repository := filepath.Join(workDir, "models")
	if err := saveModel(repository, "tiny", tiny); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var err error
	plain, err = startServer("plain", "--model_repository="+repository)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	client, err = attnserve.Dial(plain.address)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		plain.kill()
		return 1
	}
	code := m.Run()
	client.Close()
	if err := plain.stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	return code
}

// --- The server process ------------------------------------------------

type server struct {
	cmd     *exec.Cmd
	address string
	stderr  string // its file
	exited  chan error
}

// startServer starts attnserve on a free port of 127.0.0.1 and waits for the
// line that names its address.
func startServer(name string, flags ...string) (*server, error) {
	s := &server{stderr: filepath.Join(workDir, name+".stderr"),
		exited: make(chan error, 1)}
	stderr, err := os.Create(s.stderr)
	if err != nil {
		return nil, err
	}
	defer stderr.Close()
	args := append([]string{"--host=127.0.0.1", "--port=0", "--metrics_port=-1", "--http_port=-1",
		"--threads=2", "--lame_duck_seconds=0", "--drain_seconds=5"}, flags...)
	s.cmd = exec.Command(serverBin, args...)
	s.cmd.Stderr = stderr
	// Should this process die without stopping it, the server goes too.
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	found := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(stdout)
		for lines.Scan() {
			if strings.HasPrefix(lines.Text(), banner) {
				found <- strings.Fields(strings.TrimPrefix(lines.Text(), banner))[0]
				break
			}
		}
		// Drained to the end, so that the server never blocks on a full pipe.
		io.Copy(io.Discard, stdout)
		s.exited <- s.cmd.Wait()
	}()
	select {
	case s.address = <-found:
		return s, nil
	case err := <-s.exited:
		s.exited <- err
		return nil, fmt.Errorf("%s server exited at start (%v): %s", name, err,
			s.log())
	case <-time.After(30 * time.Second):
		s.kill()
		return nil, fmt.Errorf("%s server did not start: %s", name, s.log())
	}
}

func (s *server) log() string {
	text, _ := os.ReadFile(s.stderr)
	return string(text)
}

// stop sends SIGTERM and expects a clean exit within the drain time.
func (s *server) stop() error {
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-s.exited:
		if err != nil {
			return fmt.Errorf("server at %s exited with %v: %s", s.address, err,
				s.log())
		}
		return nil
	case <-time.After(20 * time.Second):
		s.kill()
		return fmt.Errorf("server at %s did not stop on SIGTERM", s.address)
	}
}

func (s *server) kill() {
	s.cmd.Process.Kill()
	<-s.exited
}

// startTestServer is startServer for one test, stopped when it ends.
func startTestServer(t *testing.T, name string, flags ...string) *server {
	t.Helper()
	s, err := startServer(name, flags...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.stop(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func dial(t *testing.T, address string, options ...attnserve.Option) *attnserve.Client {
	t.Helper()
	c, err := attnserve.Dial(address, options...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func callContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// --- Arrays and references ---------------------------------------------

// array is a row-major float64 array; its float32 rounding is what is sent.
type array struct {
	shape []int64
	data  []float64
}

func randn(rng *mathrand.Rand, shape ...int64) array {
	n, err := attnserve.NumElements(shape)
	if err != nil {
		panic(err)
	}
	a := array{shape: shape, data: make([]float64, n)}
	for i := range a.data {
		a.data[i] = float64(float32(rng.NormFloat64()))
	}
	return a
}

func (a array) tensor(t *testing.T) *pb.Tensor {
	t.Helper()
	values := make([]float32, len(a.data))
	for i, v := range a.data {
		values[i] = float32(v)
	}
	tensor, err := attnserve.Float32Tensor(values, a.shape...)
	if err != nil {
		t.Fatal(err)
	}
	return tensor
}

// expectClose compares a FLOAT32 result with its reference.
func expectClose(t *testing.T, what string, got *pb.Tensor, want array) {
	t.Helper()
	if got.GetDtype() != pb.DataType_DATA_TYPE_FLOAT32 {
		t.Fatalf("%s: dtype %v, want FLOAT32", what, got.GetDtype())
	}
	if fmt.Sprint(got.GetShape()) != fmt.Sprint(want.shape) {
		t.Fatalf("%s: shape %v, want %v", what, got.GetShape(), want.shape)
	}
	values, err := attnserve.Float32s(got)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	worst := 0.0
	for i, v := range values {
		diff := math.Abs(float64(v) - want.data[i])
		if !(diff <= tol*(1+math.Abs(want.data[i]))) {
			t.Fatalf("%s: element %d is %g, want %g", what, i, v, want.data[i])
		}
		worst = math.Max(worst, diff)
	}
	t.Logf("%s: %v, max |diff| %.3g", what, want.shape, worst)
}

type attendOptions struct {
	causal      bool
	scale       float64 // 0: 1/sqrt(dk)
	temperature float64 // 0: 1
}

// attendReference is softmax(Q K^T scale / temperature) V over the leading
// dims, and the weights, with causal masking aligned top-left.
func attendReference(q, k, v array, o attendOptions) (out, weights array) {
	rank := len(q.shape)
	lq, dk := q.shape[rank-2], q.shape[rank-1]
	lk, dv := k.shape[rank-2], v.shape[rank-1]
	batch := int64(len(q.data)) / (lq * dk)
	scale := o.scale
	if scale == 0 {
		scale = 1 / math.Sqrt(float64(dk))
	}
	if o.temperature != 0 {
		scale /= o.temperature
	}
	out = array{shape: append(append([]int64(nil), q.shape[:rank-1]...), dv),
		data: make([]float64, batch*lq*dv)}
	weights = array{shape: append(append([]int64(nil), q.shape[:rank-1]...), lk),
		data: make([]float64, batch*lq*lk)}
	for b := int64(0); b < batch; b++ {
		for i := int64(0); i < lq; i++ {
			row := weights.data[(b*lq+i)*lk : (b*lq+i+1)*lk]
			top := math.Inf(-1)
			for j := int64(0); j < lk; j++ {
				row[j] = math.Inf(-1)
				if o.causal && j > i {
					continue
				}
				dot := 0.0
				for d := int64(0); d < dk; d++ {
					dot += q.data[(b*lq+i)*dk+d] * k.data[(b*lk+j)*dk+d]
				}
				row[j] = dot * scale
				top = math.Max(top, row[j])
			}
			sum := 0.0
			for j := range row {
				row[j] = math.Exp(row[j] - top)
				sum += row[j]
			}
			for j := range row {
				row[j] /= sum
				for d := int64(0); d < dv; d++ {
					out.data[(b*lq+i)*dv+d] += row[j] * v.data[(b*lk+int64(j))*dv+d]
				}
			}
		}
	}
	return out, weights
}

// --- Attend ------------------------------------------------------------

func TestAttend(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(1))
	for _, c := range []struct {
		name    string
		q, k, v []int64
		options attendOptions
	}{
		{"batch dims, Lq != Lk, dv != dk", []int64{2, 3, 5, 8},
			[]int64{2, 3, 7, 8}, []int64{2, 3, 7, 6}, attendOptions{}},
		{"causal, scale and temperature", []int64{2, 6, 16}, []int64{2, 9, 16},
			[]int64{2, 9, 4}, attendOptions{causal: true, scale: 0.2, temperature: 1.5}},
	} {
		t.Run(c.name, func(t *testing.T) {
			q, k, v := randn(rng, c.q...), randn(rng, c.k...), randn(rng, c.v...)
			request := &pb.AttendRequest{Query: q.tensor(t), Key: k.tensor(t),
				Value: v.tensor(t), Causal: c.options.causal, ReturnWeights: true}
			if c.options.scale != 0 {
				scale := float32(c.options.scale)
				request.Scale = &scale
			}
			if c.options.temperature != 0 {
				temperature := float32(c.options.temperature)
				request.Temperature = &temperature
			}
			response, err := client.Attend(callContext(t), request)
			if err != nil {
				t.Fatal(err)
			}
			out, weights := attendReference(q, k, v, c.options)
			expectClose(t, "output", response.GetOutput(), out)
			expectClose(t, "weights", response.GetWeights(), weights)
		})
	}
}

// --- Decode sessions ---------------------------------------------------

// repeatHeads is [heads, L, d] with each head repeated group times in
// place (PyTorch's repeat_interleave on dim 0).
func repeatHeads(a array, group int64) array {
	heads, plane := a.shape[0], a.shape[1]*a.shape[2]
	out := array{shape: []int64{heads * group, a.shape[1], a.shape[2]}}
	for h := int64(0); h < heads; h++ {
		for g := int64(0); g < group; g++ {
			out.data = append(out.data, a.data[h*plane:(h+1)*plane]...)
		}
	}
	return out
}

// appendTokens joins [heads, L1, d] and [heads, L2, d] along L.
func appendTokens(a, b array) array {
	if a.data == nil {
		return b
	}
	heads, d := a.shape[0], a.shape[2]
	l1, l2 := a.shape[1], b.shape[1]
	out := array{shape: []int64{heads, l1 + l2, d}}
	for h := int64(0); h < heads; h++ {
		out.data = append(out.data, a.data[h*l1*d:(h+1)*l1*d]...)
		out.data = append(out.data, b.data[h*l2*d:(h+1)*l2*d]...)
	}
	return out
}

func TestDecodeSession(t *testing.T) {
	// Grouped-query attention: 4 query heads over 2 key/value heads, a
	// 5-token prompt (causal) and then one token a step, each against
	// attention over the whole history in float64.
	rng := mathrand.New(mathrand.NewSource(9))
	session, err := client.CreateSession(callContext(t), &pb.CreateSessionRequest{
		NumHeads: 4, NumKvHeads: 2, HeadDim: 8, MaxLength: 16})
	if err != nil {
		t.Fatal(err)
	}
	var keys, values array
	for step, n := range []int64{5, 1, 1, 1} {
		q, k, v := randn(rng, 4, n, 8), randn(rng, 2, n, 8), randn(rng, 2, n, 8)
		response, err := client.SessionStep(callContext(t), &pb.SessionStepRequest{
			SessionId: session.GetSessionId(), Query: q.tensor(t),
			Key: k.tensor(t), Value: v.tensor(t)})
		if err != nil {
			t.Fatal(err)
		}
		keys, values = appendTokens(keys, k), appendTokens(values, v)
		if response.GetLength() != keys.shape[1] {
			t.Fatalf("length %d, want %d", response.GetLength(), keys.shape[1])
		}
		// The prompt attends causally to itself; a single new token sees
		// every cached one.
		out, _ := attendReference(q, repeatHeads(keys, 2), repeatHeads(values, 2),
			attendOptions{causal: step == 0})
		expectClose(t, fmt.Sprintf("step %d", step), response.GetOutput(), out)
	}
	if err := client.DeleteSession(callContext(t), session.GetSessionId()); err != nil {
		t.Fatal(err)
	}
	_, err = client.SessionStep(callContext(t), &pb.SessionStepRequest{
		SessionId: session.GetSessionId(),
		Query:     randn(rng, 4, 1, 8).tensor(t),
		Key:       randn(rng, 2, 1, 8).tensor(t),
		Value:     randn(rng, 2, 1, 8).tensor(t)})
	expectStatus(t, err, codes.NotFound,
		fmt.Sprintf("session_id: session %q was deleted", session.GetSessionId()))
}

func TestSessionMovesThroughExportAndImport(t *testing.T) {
	// A session exported, deleted and imported again holds its tokens: its
	// next step attends to all of them. The import is cut short once and
	// resumed by ImportSession.
	rng := mathrand.New(mathrand.NewSource(11))
	session, err := client.CreateSession(callContext(t), &pb.CreateSessionRequest{
		NumHeads: 4, NumKvHeads: 2, HeadDim: 8, MaxLength: 16})
	if err != nil {
		t.Fatal(err)
	}
	id := session.GetSessionId()
	k, v := randn(rng, 2, 6, 8), randn(rng, 2, 6, 8)
	if _, err := client.SessionStep(callContext(t), &pb.SessionStepRequest{
		SessionId: id, Query: randn(rng, 4, 6, 8).tensor(t), Key: k.tensor(t),
		Value: v.tensor(t)}); err != nil {
		t.Fatal(err)
	}
	data, err := client.ExportSession(callContext(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(data, []byte("ATTNSESS")) {
		t.Fatalf("export: %d bytes not starting with the file's magic", len(data))
	}
	if err := client.DeleteSession(callContext(t), id); err != nil {
		t.Fatal(err)
	}
	// Half the file in one stream: the import waits under the session's id.
	stream, err := client.Conn().NewStream(callContext(t),
		&grpc.StreamDesc{ClientStreams: true},
		"/attnserve.v1.AttentionService/ImportSession")
	if err != nil {
		t.Fatal(err)
	}
	half := len(data) / 2
	partial := &pb.ImportSessionResponse{}
	if err := stream.SendMsg(&pb.ImportSessionChunk{Data: data[:half]}); err != nil {
		t.Fatal(err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := stream.RecvMsg(partial); err != nil {
		t.Fatal(err)
	}
	if partial.GetReceived() != uint64(half) || partial.GetSize() != uint64(len(data)) {
		t.Fatalf("partial import took %d of %d bytes, want %d of %d",
			partial.GetReceived(), partial.GetSize(), half, len(data))
	}
	imported, err := client.ImportSession(callContext(t), data, id, 64)
	if err != nil {
		t.Fatal(err)
	}
	if imported.GetSessionId() != id || len(imported.GetLengths()) != 1 ||
		imported.GetLengths()[0] != 6 {
		t.Fatalf("imported %q with lengths %v, want %q with [6]",
			imported.GetSessionId(), imported.GetLengths(), id)
	}
	q, k1, v1 := randn(rng, 4, 1, 8), randn(rng, 2, 1, 8), randn(rng, 2, 1, 8)
	step, err := client.SessionStep(callContext(t), &pb.SessionStepRequest{
		SessionId: id, Query: q.tensor(t), Key: k1.tensor(t), Value: v1.tensor(t)})
	if err != nil {
		t.Fatal(err)
	}
	keys, values := appendTokens(k, k1), appendTokens(v, v1)
	out, _ := attendReference(q, repeatHeads(keys, 2), repeatHeads(values, 2),
		attendOptions{})
	expectClose(t, "step after the import", step.GetOutput(), out)
	// A second import of the same file would be a second copy.
	_, err = client.ImportSession(callContext(t), data, "", 1<<20)
	expectStatus(t, err, codes.AlreadyExists,
		fmt.Sprintf("session %q is open here; delete it before importing it", id))
	if err := client.DeleteSession(callContext(t), id); err != nil {
		t.Fatal(err)
	}
}

func TestAttendRefusesMismatchedKey(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(3))
	_, err := client.Attend(callContext(t), &pb.AttendRequest{
		Query: randn(rng, 2, 5, 8).tensor(t),
		Key:   randn(rng, 2, 5, 6).tensor(t),
		Value: randn(rng, 2, 5, 8).tensor(t)})
	expectStatus(t, err, codes.InvalidArgument,
		"key: last dim 6 != query last dim 8")
}

func expectStatus(t *testing.T, err error, code codes.Code, message string) {
	t.Helper()
	s, ok := status.FromError(err)
	if err == nil || !ok || s.Code() != code || s.Message() != message {
		t.Fatalf("got %v, want %v %q", err, code, message)
	}
}

// --- LayerNorm ---------------------------------------------------------

func layerNormReference(x, gamma, beta array, normalized int64, eps float64) array {
	out := array{shape: x.shape, data: make([]float64, len(x.data))}
	for start := int64(0); start < int64(len(x.data)); start += normalized {
		row := x.data[start : start+normalized]
		mean, variance := 0.0, 0.0
		for _, v := range row {
			mean += v
		}
		mean /= float64(normalized)
		for _, v := range row {
			variance += (v - mean) * (v - mean)
		}
		variance /= float64(normalized) // biased, as PyTorch's
		for j, v := range row {
			out.data[start+int64(j)] = (v-mean)/math.Sqrt(variance+eps)*gamma.data[j] +
				beta.data[j]
		}
	}
	return out
}

func TestLayerNorm(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(4))
	x := randn(rng, 3, 4, 6)
	for i := range x.data {
		x.data[i] = float64(float32(3*x.data[i] + 1)) // not already normal
	}
	gamma, beta := randn(rng, 4, 6), randn(rng, 4, 6)
	eps := float32(1e-3)
	response, err := client.LayerNorm(callContext(t), &pb.LayerNormRequest{
		Input: x.tensor(t), Gamma: gamma.tensor(t), Beta: beta.tensor(t),
		Eps: &eps, NormalizedNdim: 2})
	if err != nil {
		t.Fatal(err)
	}
	expectClose(t, "output", response.GetOutput(),
		layerNormReference(x, gamma, beta, 24, float64(eps)))
}

// x / sqrt(mean(x^2) + eps) * gamma over rows of `normalized` values.
func rmsNormReference(x, gamma array, normalized int64, eps float64) array {
	out := array{shape: x.shape, data: make([]float64, len(x.data))}
	for start := int64(0); start < int64(len(x.data)); start += normalized {
		row := x.data[start : start+normalized]
		squares := 0.0
		for _, v := range row {
			squares += v * v
		}
		inverse := 1 / math.Sqrt(squares/float64(normalized)+eps)
		for j, v := range row {
			out.data[start+int64(j)] = v * inverse * gamma.data[j]
		}
	}
	return out
}

func TestRmsNorm(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(9))
	x := randn(rng, 3, 4, 6)
	gamma := randn(rng, 4, 6)
	eps := float32(1e-3)
	response, err := client.RmsNorm(callContext(t), &pb.RmsNormRequest{
		Input: x.tensor(t), Gamma: gamma.tensor(t), Eps: &eps,
		NormalizedNdim: 2})
	if err != nil {
		t.Fatal(err)
	}
	expectClose(t, "output", response.GetOutput(),
		rmsNormReference(x, gamma, 24, float64(eps)))
}

func TestLayerNormBFloat16(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(2))
	x := randn(rng, 3, 16)
	values := make([]float32, len(x.data))
	for i, v := range x.data {
		values[i] = float32(v)
	}
	input, err := attnserve.BFloat16Tensor(values, x.shape...)
	if err != nil {
		t.Fatal(err)
	}
	response, err := client.LayerNorm(callContext(t), &pb.LayerNormRequest{Input: input})
	if err != nil {
		t.Fatal(err)
	}
	if response.GetOutput().GetDtype() != pb.DataType_DATA_TYPE_BFLOAT16 {
		t.Fatalf("dtype %v, want BFLOAT16", response.GetOutput().GetDtype())
	}
	got, err := attnserve.Float32s(response.GetOutput())
	if err != nil {
		t.Fatal(err)
	}
	// The server widens the bfloat16 input and rounds the result: both within
	// 2^-9 relative of the float32 values; the README's bound is 2e-2.
	ones := array{shape: []int64{16}, data: make([]float64, 16)}
	for i := range ones.data {
		ones.data[i] = 1
	}
	want := layerNormReference(x, ones, array{data: make([]float64, 16)}, 16, 1e-5)
	for i, v := range got {
		if diff := math.Abs(float64(v) - want.data[i]); !(diff <= 2e-2*(1+math.Abs(want.data[i]))) {
			t.Fatalf("element %d is %g, want %g", i, v, want.data[i])
		}
	}
}

func TestLayerNormRefusesBadEps(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(5))
	eps := float32(-1)
	_, err := client.LayerNorm(callContext(t), &pb.LayerNormRequest{
		Input: randn(rng, 2, 4).tensor(t), Eps: &eps})
	expectStatus(t, err, codes.InvalidArgument, "eps: must be finite and > 0, got -1")
}

// --- Multi-head attention ----------------------------------------------

// mhaWeights are nn.MultiheadAttention's: [E, E] projections and biases.
type mhaWeights struct {
	heads          int64
	wq, wk, wv, wo array
	bq, bk, bv, bo array
}

func randomWeights(rng *mathrand.Rand, embed, heads int64) mhaWeights {
	w := mhaWeights{heads: heads}
	for _, m := range []*array{&w.wq, &w.wk, &w.wv, &w.wo} {
		*m = randn(rng, embed, embed)
		for i := range m.data {
			m.data[i] = float64(float32(m.data[i] / math.Sqrt(float64(embed))))
		}
	}
	for _, b := range []*array{&w.bq, &w.bk, &w.bv, &w.bo} {
		*b = randn(rng, embed)
	}
	return w
}

func (w mhaWeights) named() map[string]array {
	return map[string]array{
		"q_proj_weight": w.wq, "k_proj_weight": w.wk, "v_proj_weight": w.wv,
		"out_proj_weight": w.wo, "q_proj_bias": w.bq, "k_proj_bias": w.bk,
		"v_proj_bias": w.bv, "out_proj_bias": w.bo,
	}
}

// saveModel writes DIR/NAME/config.pbtxt and weights.safetensors.
func saveModel(dir, name string, w mhaWeights) error {
	folder := filepath.Join(dir, name)
	if err := os.MkdirAll(folder, 0o755); err != nil {
		return err
	}
	config := fmt.Sprintf("num_heads: %d\ndescription: \"test model\"\n", w.heads)
	if err := os.WriteFile(filepath.Join(folder, "config.pbtxt"), []byte(config),
		0o644); err != nil {
		return err
	}
	header := map[string]interface{}{}
	var data bytes.Buffer
	for key, a := range w.named() {
		start := data.Len()
		for _, v := range a.data {
			binary.Write(&data, binary.LittleEndian, float32(v))
		}
		header[key] = map[string]interface{}{"dtype": "F32", "shape": a.shape,
			"data_offsets": []int{start, data.Len()}}
	}
	text, err := json.Marshal(header)
	if err != nil {
		return err
	}
	var file bytes.Buffer
	binary.Write(&file, binary.LittleEndian, uint64(len(text)))
	file.Write(text)
	file.Write(data.Bytes())
	return os.WriteFile(filepath.Join(folder, "weights.safetensors"), file.Bytes(),
		0o644)
}

// linear is x W^T + b over x's last dim.
func linear(x, w, b array) array {
	in, outDim := w.shape[1], w.shape[0]
	rows := int64(len(x.data)) / in
	y := array{shape: append(append([]int64(nil), x.shape[:len(x.shape)-1]...), outDim),
		data: make([]float64, rows*outDim)}
	for r := int64(0); r < rows; r++ {
		for o := int64(0); o < outDim; o++ {
			sum := b.data[o]
			for i := int64(0); i < in; i++ {
				sum += x.data[r*in+i] * w.data[o*in+i]
			}
			y.data[r*outDim+o] = sum
		}
	}
	return y
}

// splitHeads turns [B, L, H*d] into [B, H, L, d].
func splitHeads(x array, heads int64) array {
	b, l, hd := x.shape[0], x.shape[1], x.shape[2]
	d := hd / heads
	y := array{shape: []int64{b, heads, l, d}, data: make([]float64, len(x.data))}
	for i := int64(0); i < b; i++ {
		for h := int64(0); h < heads; h++ {
			for j := int64(0); j < l; j++ {
				copy(y.data[((i*heads+h)*l+j)*d:((i*heads+h)*l+j+1)*d],
					x.data[(i*l+j)*hd+h*d:(i*l+j)*hd+(h+1)*d])
			}
		}
	}
	return y
}

// mergeHeads is the inverse of splitHeads.
func mergeHeads(y array) array {
	b, heads, l, d := y.shape[0], y.shape[1], y.shape[2], y.shape[3]
	x := array{shape: []int64{b, l, heads * d}, data: make([]float64, len(y.data))}
	for i := int64(0); i < b; i++ {
		for h := int64(0); h < heads; h++ {
			for j := int64(0); j < l; j++ {
				copy(x.data[(i*l+j)*heads*d+h*d:(i*l+j)*heads*d+(h+1)*d],
					y.data[((i*heads+h)*l+j)*d:((i*heads+h)*l+j+1)*d])
			}
		}
	}
	return x
}

func mhaReference(w mhaWeights, query, kv array) (out, weights array) {
	q := splitHeads(linear(query, w.wq, w.bq), w.heads)
	k := splitHeads(linear(kv, w.wk, w.bk), w.heads)
	v := splitHeads(linear(kv, w.wv, w.bv), w.heads)
	heads, weights := attendReference(q, k, v, attendOptions{})
	return linear(mergeHeads(heads), w.wo, w.bo), weights
}

func TestModels(t *testing.T) {
	models, err := client.ListModels(callContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(models) != 1 || models[0].GetName() != "tiny" ||
		models[0].GetNumHeads() != 2 || models[0].GetEmbedDim() != 8 {
		t.Fatalf("models %v, want tiny with 2 heads, E=8", models)
	}
	meta, err := client.GetModelMetadata(callContext(t), "tiny")
	if err != nil {
		t.Fatal(err)
	}
	if meta.GetPlatform() != "attnserve_multi_head_attention" ||
		meta.GetQueryDim() != 8 || meta.GetHeadKeyDim() != 4 ||
		meta.GetOutputDim() != 8 || meta.GetDescription() != "test model" ||
		meta.GetComputeDtype() != pb.DataType_DATA_TYPE_FLOAT32 {
		t.Fatalf("metadata %v", meta)
	}
	_, err = client.GetModelMetadata(callContext(t), "absent")
	if status.Code(err) != codes.NotFound ||
		!strings.Contains(status.Convert(err).Message(), "absent") {
		t.Fatalf("metadata of an absent model: %v, want NotFound naming it", err)
	}
}

func TestMultiHeadAttend(t *testing.T) {
	rng := mathrand.New(mathrand.NewSource(6))
	query, kv := randn(rng, 2, 5, 8), randn(rng, 2, 7, 8)
	out, weights := mhaReference(tiny, query, kv)
	inline := &pb.AttentionWeights{NumHeads: int32(tiny.heads),
		QProjWeight: tiny.wq.tensor(t), KProjWeight: tiny.wk.tensor(t),
		VProjWeight: tiny.wv.tensor(t), OutProjWeight: tiny.wo.tensor(t),
		QProjBias: tiny.bq.tensor(t), KProjBias: tiny.bk.tensor(t),
		VProjBias: tiny.bv.tensor(t), OutProjBias: tiny.bo.tensor(t)}
	for _, c := range []struct {
		name   string
		source func(*pb.MultiHeadAttendRequest)
	}{
		{"model", func(r *pb.MultiHeadAttendRequest) {
			r.WeightsSource = &pb.MultiHeadAttendRequest_Model{Model: "tiny"}
		}},
		{"inline", func(r *pb.MultiHeadAttendRequest) {
			r.WeightsSource = &pb.MultiHeadAttendRequest_Weights{Weights: inline}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			request := &pb.MultiHeadAttendRequest{Query: query.tensor(t),
				Key: kv.tensor(t), ReturnWeights: true}
			c.source(request)
			response, err := client.MultiHeadAttend(callContext(t), request)
			if err != nil {
				t.Fatal(err)
			}
			expectClose(t, "output", response.GetOutput(), out)
			expectClose(t, "weights", response.GetWeights(), weights)
		})
	}
}

// --- Tokens and TLS ----------------------------------------------------

func TestToken(t *testing.T) {
	tokens := filepath.Join(workDir, "tokens")
	if err := os.WriteFile(tokens, []byte("go-test-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := startTestServer(t, "token", "--auth_token_file="+tokens)
	request := &pb.LayerNormRequest{Input: randn(mathrand.New(mathrand.NewSource(8)),
		2, 4).tensor(t)}
	for _, c := range []struct {
		name    string
		options []attnserve.Option
		message string
	}{
		{"missing", nil, "authorization: missing, expected 'Bearer <token>'"},
		{"wrong", []attnserve.Option{attnserve.WithToken("other-token")},
			"authorization: token not accepted"},
	} {
		t.Run(c.name, func(t *testing.T) {
			c2 := dial(t, s.address, c.options...)
			_, err := c2.LayerNorm(callContext(t), request)
			expectStatus(t, err, codes.Unauthenticated, c.message)
			// Health checks stay open, for load balancers.
			if serving, err := c2.Serving(callContext(t)); err != nil || !serving {
				t.Fatalf("health: %v, %v; want SERVING", serving, err)
			}
		})
	}
	good := dial(t, s.address, attnserve.WithToken("go-test-token"))
	if _, err := good.LayerNorm(callContext(t), request); err != nil {
		t.Fatalf("with the token: %v", err)
	}
	if _, err := good.ListModels(callContext(t)); err != nil {
		t.Fatalf("with the token: %v", err)
	}
}

func TestTokenNeedsTLSOffHost(t *testing.T) {
	for _, address := range []string{"localhost:50051", "127.0.0.1:1", "[::1]:2",
		"unix:/tmp/attnserve.sock"} {
		c, err := attnserve.Dial(address, attnserve.WithToken("t"))
		if err != nil {
			t.Errorf("%s: %v", address, err)
		} else {
			c.Close()
		}
	}
	_, err := attnserve.Dial("192.0.2.1:50051", attnserve.WithToken("t"))
	if err == nil || !strings.Contains(err.Error(), "only over TLS") {
		t.Errorf("token in the clear to 192.0.2.1: %v, want refused", err)
	}
	c, err := attnserve.Dial("192.0.2.1:50051", attnserve.WithToken("t"),
		attnserve.WithTLS(nil))
	if err != nil {
		t.Errorf("token over TLS to 192.0.2.1: %v", err)
	} else {
		c.Close()
	}
}

// writeCertificate writes a self-signed certificate for 127.0.0.1 and its
// key as PEM files.
func writeCertificate(t *testing.T, certFile, keyFile string) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	template := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "attnserve test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template,
		&key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	for file, block := range map[string]*pem.Block{
		certFile: {Type: "CERTIFICATE", Bytes: der},
		keyFile:  {Type: "PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(file, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func TestTLSWithToken(t *testing.T) {
	cert := filepath.Join(workDir, "cert.pem")
	key := filepath.Join(workDir, "key.pem")
	writeCertificate(t, cert, key)
	tokens := filepath.Join(workDir, "tls_tokens")
	if err := os.WriteFile(tokens, []byte("tls-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := startTestServer(t, "tls", "--tls_cert="+cert, "--tls_key="+key,
		"--auth_token_file="+tokens)
	config, err := attnserve.TLSConfig(cert, "", "")
	if err != nil {
		t.Fatal(err)
	}
	secured := dial(t, s.address, attnserve.WithTLS(config),
		attnserve.WithToken("tls-token"))
	models, err := secured.ListModels(callContext(t))
	if err != nil || len(models) != 0 {
		t.Fatalf("over TLS: %v, %v; want no model", models, err)
	}
	// Without TLS, the handshake fails: no call gets through.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = dial(t, s.address, attnserve.WithToken("tls-token")).ListModels(ctx)
	if code := status.Code(err); code != codes.Unavailable &&
		code != codes.DeadlineExceeded {
		t.Fatalf("without TLS: %v, want Unavailable", err)
	}
}
