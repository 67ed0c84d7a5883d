// Command example calls a running attnserve: Attend on random tensors,
// LayerNorm, and MultiHeadAttend on the server's first model if it has one.
// It prints each result's shape and checksums (sum and sum of |x|).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand"
	"time"

	"attnserve/clients/go/attnserve"
	pb "attnserve/clients/go/attnservepb"
)

func main() {
	addr := flag.String("addr", "localhost:50051", "server address, host:port")
	token := flag.String("token", "", "bearer token, for servers with --auth_token_file")
	tlsCA := flag.String("tls_ca", "", "PEM CAs of the server's certificate: connect over TLS")
	timeout := flag.Duration("timeout", 30*time.Second, "deadline of each call")
	flag.Parse()
	log.SetFlags(0)

	var options []attnserve.Option
	if *tlsCA != "" {
		config, err := attnserve.TLSConfig(*tlsCA, "", "")
		if err != nil {
			log.Fatal(err)
		}
		options = append(options, attnserve.WithTLS(config))
	}
	if *token != "" {
		options = append(options, attnserve.WithToken(*token))
	}
	client, err := attnserve.Dial(*addr, options...)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	call := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), *timeout)
	}
	rng := rand.New(rand.NewSource(1))

	// Attend: batch 2, 4 queries, 6 keys, head dim 8, causal.
	ctx, cancel := call()
	attend, err := client.Attend(ctx, &pb.AttendRequest{
		Query:  randomTensor(rng, 2, 4, 8),
		Key:    randomTensor(rng, 2, 6, 8),
		Value:  randomTensor(rng, 2, 6, 8),
		Causal: true,
	})
	cancel()
	if err != nil {
		log.Fatalf("Attend: %v", err)
	}
	report("Attend", attend.GetOutput())

	// LayerNorm over the last dim of [3, 16], with gamma and beta.
	ctx, cancel = call()
	norm, err := client.LayerNorm(ctx, &pb.LayerNormRequest{
		Input: randomTensor(rng, 3, 16),
		Gamma: randomTensor(rng, 16),
		Beta:  randomTensor(rng, 16),
	})
	cancel()
	if err != nil {
		log.Fatalf("LayerNorm: %v", err)
	}
	report("LayerNorm", norm.GetOutput())

	ctx, cancel = call()
	models, err := client.ListModels(ctx)
	cancel()
	if err != nil {
		log.Fatalf("ListModels: %v", err)
	}
	if len(models) == 0 {
		fmt.Println("MultiHeadAttend: the server has no model")
		return
	}
	ctx, cancel = call()
	meta, err := client.GetModelMetadata(ctx, models[0].GetName())
	cancel()
	if err != nil {
		log.Fatalf("GetModelMetadata: %v", err)
	}
	// Self-attention over 6 positions of one sequence.
	ctx, cancel = call()
	mha, err := client.MultiHeadAttend(ctx, &pb.MultiHeadAttendRequest{
		WeightsSource: &pb.MultiHeadAttendRequest_Model{Model: meta.GetName()},
		Query:         randomTensor(rng, 1, 6, meta.GetQueryDim()),
	})
	cancel()
	if err != nil {
		log.Fatalf("MultiHeadAttend: %v", err)
	}
	report(fmt.Sprintf("MultiHeadAttend (%s, %d heads)", meta.GetName(),
		meta.GetNumHeads()), mha.GetOutput())
}

// randomTensor is a FLOAT32 tensor of standard normal values.
func randomTensor(rng *rand.Rand, shape ...int64) *pb.Tensor {
	n, err := attnserve.NumElements(shape)
	if err != nil {
		log.Fatal(err)
	}
	data := make([]float32, n)
	for i := range data {
		data[i] = float32(rng.NormFloat64())
	}
	t, err := attnserve.Float32Tensor(data, shape...)
	if err != nil {
		log.Fatal(err)
	}
	return t
}

func report(name string, t *pb.Tensor) {
	values, err := attnserve.Float32s(t)
	if err != nil {
		log.Fatalf("%s: %v", name, err)
	}
	var sum, sumAbs float64
	for _, v := range values {
		sum += float64(v)
		sumAbs += math.Abs(float64(v))
	}
	fmt.Printf("%s: output %v %v, sum %.6f, sum |x| %.6f\n", name,
		t.GetDtype(), t.GetShape(), sum, sumAbs)
}
